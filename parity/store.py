"""A store of finished runs, keyed by everything that decides their numbers, so that `parity
check` runs its base revision once per key instead of once per check (CI checks every pull
request against the same main until main moves).

The key (`run_key`) is a hash of: the revision's git tree (its content, not its commit: a
squash-merge of an up-to-date branch has its head's tree), the digests of the inputs carried into
it, the job spec as given (launcher and topology included), and the environment the run will
have: Python, the interpreter's path, every installed distribution and its version, the code no
version pins (each PYTHONPATH folder's and editable install's Python sources and extension
modules, by content, outside the repository being checked), the harness's version, the
machine, its CPU's instruction sets and vendor, the GPUs the driver lists, and the variables
that change kernels or code (threads, BLAS, oneDNN, CUDA, NCCL, torch, PYTHONPATH,
LD_LIBRARY_PATH, LD_PRELOAD...). `key.json`
beside each stored run lists them, for a person asking why a run was or was not reused.

A key can still miss a cause (a data file the job reads by an absolute path outside git, that
nobody carried). Where the reused base and the head do not agree, `parity check` runs the base
again before it gives a verdict (parity.check), so there a stale key costs a run; where they
agree, the key is trusted: a cause it misses can let a stale base agree with a head that a fresh
base would not (`--fresh` runs it, and replaces what was stored).

Layout, in a folder of the harness's own (marked by ``.parity-store``; any other folder is refused,
so nothing of the user's is ever evicted)::

    STORE/.parity-store         the mark (empty)
    STORE/lock                  flock: shared while a run is read, exclusive to add or evict
    STORE/runs/<key>/key.json   what the key was made of
    STORE/runs/<key>/run/       the run folder, as the job left it
    STORE/runs/<key>/stored.json  written last: every file's size and sha256, the revision, when
    STORE/tmp/                  runs being added (a rename into runs/ makes one visible)

A stored run is complete or absent: it becomes visible by one rename of a folder whose
``stored.json`` was written last, and it is read only after every file's checksum is verified, so
a run cut short, edited or half-evicted is never used (`get` returns None and says why). Two
commands can share a store: a second copy of a run already there is dropped, eviction renames
before it removes, and a reader holds the lock while it verifies and copies. The store is bounded
(`max_bytes`): the least recently used runs go first.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import platform
import shutil
import sys
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse
from urllib.request import url2pathname

from parity.errors import InputError
from parity.files import write_json_atomic
from parity.git import git
from parity.spec import JobSpec

if TYPE_CHECKING:
    from parity.carry import Carry

__all__ = [
    "DEFAULT_MAX_BYTES",
    "RunKey",
    "RunStore",
    "StoreError",
    "StoredRun",
    "commit_key",
    "default_store",
    "run_key",
    "tree_of",
]

STORE_ENV = "PARITY_STORE"  # the store's folder; "off": no store
MAX_ENV = "PARITY_STORE_MAX_MB"
DEFAULT_MAX_BYTES = 2 << 30
MARK = ".parity-store"
_CHUNK = 1 << 20

#: environment variables that change which kernels run or which code is imported (the key holds
#: each one set); the store's own are not among them
KEY_VARIABLES = ("PYTHONPATH", "PYTHONHASHSEED", "CUDA_VISIBLE_DEVICES", "CUBLAS_WORKSPACE_CONFIG",
                 "LD_LIBRARY_PATH", "LD_PRELOAD")  # fmt: skip
KEY_PREFIXES = ("OMP_", "MKL_", "KMP_", "OPENBLAS_", "ATEN_", "TORCH", "PYTORCH_", "NCCL_",
                "CUDA_", "CUDNN_", "NVIDIA_", "HIP_", "ROCM_", "XLA_", "DNNL_", "ONEDNN_",
                "PARITY_")  # fmt: skip
_NOT_KEY = (STORE_ENV, MAX_ENV)
CODE_SUFFIXES = (".py", ".so", ".pyd", ".pth")  # what a code folder's key is made of
MAX_CODE_BYTES = 512 << 20  # a code folder with more is not read: no run of it is reused
MAX_CODE_FILES = 200_000  # nor one of more files and folders (a data folder on PYTHONPATH)
_SKIPPED_DIRS = ("__pycache__", "node_modules")  # and every folder whose name starts with "."


class StoreError(InputError):
    """A store folder that is not one (the user's folder, a file): one line, exit 2."""


@dataclass(frozen=True)
class RunKey:
    """A run's key (``digest``) and what it was made of (``facts``, written as key.json)."""

    digest: str
    facts: dict[str, Any]
    #: False where the key could not hold everything it should (a code folder too big to
    #: read): such a run is neither taken from the store nor put into it
    reusable: bool = True


@dataclass
class StoredRun:
    """A run taken from the store: where it was copied to, and what stored.json says of it."""

    dir: Path
    key: RunKey
    meta: dict[str, Any] = field(default_factory=dict)

    def line(self) -> str:
        """How output and report name it: "reused run of <rev> (<commit>) from <date>"."""
        when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(self.meta.get("stored_at", 0)))
        rev, commit = self.meta.get("rev") or "?", (self.meta.get("commit") or "")[:12]
        return f"reused run of {rev}" + (f" ({commit})" if commit else "") + f" from {when}"


def default_store() -> Path | None:
    """The store's folder: $PARITY_STORE, else the user's cache; None when $PARITY_STORE is
    "off"."""
    value = os.environ.get(STORE_ENV, "")
    if value.lower() == "off":
        return None
    if value:
        return Path(value).expanduser()
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "llm-parity" / "runs"


def tree_of(repo: Path, commit: str) -> str:
    """The git tree id of ``commit``: its content, whatever its history or message."""
    return git(repo, "rev-parse", "--end-of-options", f"{commit}^{{tree}}")


def commit_key(spec: JobSpec, repo: Path, commit: str, carried: Carry | None = None) -> RunKey:
    """The key of a run of ``spec`` at ``commit`` of ``repo`` with the inputs ``carried``
    (parity.carry) copied into its worktree: check's and bisect's runs."""
    inputs = [c.to_dict() for c in carried.carried] if carried is not None else []
    return run_key(spec, tree_of(repo, commit), inputs, repo=repo)


def run_key(
    spec: JobSpec,
    tree: str,
    carried: Sequence[Mapping[str, Any]] = (),
    env: Mapping[str, str] | None = None,
    repo: Path | None = None,
) -> RunKey:
    """The key of a run of ``spec`` in the git tree ``tree`` with the inputs ``carried``
    (parity.carry's path/size/sha256), in this environment (``env``: os.environ). ``repo``: the
    repository ``tree`` is of, whose code the tree keys already (an editable install of the
    project being checked is its checkout: a pull request's edits must not move main's key)."""
    facts = {
        "tree": tree,
        "carried": sorted(
            ({"path": c["path"], "sha256": c["sha256"]} for c in carried), key=lambda c: c["path"]
        ),  # fmt: skip
        "spec": spec.to_dict(),
        "environment": environment_facts(os.environ if env is None else env, repo),
    }
    text = json.dumps(facts, sort_keys=True, default=str)
    reusable = None not in facts["environment"]["code"].values()
    return RunKey(hashlib.sha256(text.encode()).hexdigest()[:32], facts, reusable)


def environment_facts(env: Mapping[str, str], repo: Path | None = None) -> dict[str, Any]:
    """What of this machine and interpreter can change a run's numbers, read without starting
    the job (and without importing torch); the code folders outside ``repo`` (None: one too
    big to read)."""
    from importlib import metadata

    from parity.record.env import cpu_facts

    distributions = list(metadata.distributions())
    packages = sorted({(d.metadata["Name"] or "", d.version) for d in distributions})
    try:
        cpu = cpu_facts(Path("/proc/cpuinfo").read_text())
    except OSError:
        cpu = {}
    return {
        "python": sys.version,
        "executable": sys.executable,
        "packages": hashlib.sha256(json.dumps(packages).encode()).hexdigest()[:32],
        "harness": _harness_version(),
        "machine": platform.machine(),
        "cpu_isa": cpu.get("cpu_isa"),
        "cpu_vendor": cpu.get("cpu_vendor"),
        "gpus": _gpus(),
        "variables": {k: v for k, v in sorted(env.items())
                      if k not in _NOT_KEY and (k in KEY_VARIABLES or k.startswith(KEY_PREFIXES))},
        "code": {str(f): _folder_state(f) for f in code_folders(env, distributions, repo)},
    }  # fmt: skip


def code_folders(
    env: Mapping[str, str], distributions: Sequence[Any], repo: Path | None = None
) -> list[Path]:
    """The folders of code a job may import that no distribution's version pins: PYTHONPATH's
    entries and the sources of editable installs (``pip install -e``: their code changes, their
    version does not). Not those in ``repo`` (its tree is keyed), nor a site-packages (its
    distributions are)."""
    found = [Path(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    for dist in distributions:
        with contextlib.suppress(OSError, ValueError, TypeError, AttributeError):
            url = json.loads(dist.read_text("direct_url.json") or "null")
            if url and url.get("dir_info", {}).get("editable") and url["url"].startswith("file:"):
                found.append(Path(url2pathname(urlparse(url["url"]).path)))
    inside = Path(os.path.realpath(repo)) if repo is not None else None
    kept: dict[Path, Path] = {}  # its real path -> the folder as given
    for folder in found:
        real = Path(os.path.realpath(folder))
        if real.name in ("site-packages", "dist-packages"):
            continue
        if inside is not None and (real == inside or inside in real.parents):
            continue
        kept.setdefault(real, folder.absolute())
    return sorted(f for real, f in kept.items() if not _read_with(real, kept))


def _read_with(real: Path, folders: Mapping[Path, Path]) -> bool:
    """Whether the folder ``real`` lies in another of ``folders`` whose walk reads it (no
    folder between them that ``_folder_state`` skips): it is then read once, with that one."""
    for parent in real.parents:
        if parent in folders:
            between = real.relative_to(parent).parts
            return not any(d.startswith(".") or d in _SKIPPED_DIRS for d in between)
    return False


def _folder_state(folder: Path) -> str | None:
    """A digest of the code under ``folder``: every Python source, extension module and .pth
    file, by path and content (so a fresh clone of the same code has the same key). None for a
    folder past MAX_CODE_FILES entries or MAX_CODE_BYTES of code (looked at by their sizes
    first): a run of it is neither stored nor reused (``RunKey.reusable``)."""
    code, entries, size = [], 0, 0
    for top, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in _SKIPPED_DIRS)
        entries += len(dirs) + len(files)
        if entries > MAX_CODE_FILES:
            return None
        for name in sorted(f for f in files if f.endswith(CODE_SUFFIXES)):
            path = os.path.join(top, name)
            with contextlib.suppress(OSError):
                size += os.path.getsize(path)
                code.append(path)
        if size > MAX_CODE_BYTES:
            return None
    h = hashlib.sha256()
    for path in code:
        with contextlib.suppress(OSError):
            h.update(f"{os.path.relpath(path, folder)}\0{_sha256(Path(path))}\n".encode())
    return f"{len(code)} files {h.hexdigest()[:32]}"


def _harness_version() -> str | None:
    from parity.record.env import package_version

    return package_version("llm-parity")


def _gpus() -> list[str]:
    """The GPU models the NVIDIA driver lists (/proc/driver/nvidia), without starting CUDA."""
    found = []
    for info in sorted(Path("/proc/driver/nvidia/gpus").glob("*/information")):
        with contextlib.suppress(OSError):
            model = [ln for ln in info.read_text().splitlines() if ln.startswith("Model:")]
            found += [m.split(":", 1)[1].strip() for m in model]
    return found


class RunStore:
    """One store folder (see the module's docstring): `get` a run by key into a folder of the
    caller's, `put` a finished run under its key."""

    def __init__(self, root: Path, max_bytes: int | None = None):
        self.root = Path(root).expanduser().resolve()
        if max_bytes is None:
            mb = os.environ.get(MAX_ENV, "")
            max_bytes = int(mb) << 20 if mb.isdigit() else DEFAULT_MAX_BYTES
        self.max_bytes = max_bytes
        self._open()

    def _open(self) -> None:
        """Make the store (an empty or missing folder), or take one it made; refuse the rest."""
        root = self.root
        if root.exists() and not root.is_dir():
            raise StoreError(f"{root}: not a folder; give the run store a folder of its own")
        if root.is_dir() and not (root / MARK).is_file() and any(root.iterdir()):
            raise StoreError(f"{root}: a folder that is not a parity run store (no {MARK}); "
                             "give the store an empty or new folder")  # fmt: skip
        try:  # the mark first: a command opening it meanwhile sees a store, never a folder
            root.mkdir(parents=True, exist_ok=True)  # that holds runs/ but no mark yet
            (root / MARK).touch()
            for sub in ("runs", "tmp"):
                (root / sub).mkdir(exist_ok=True)
        except OSError as e:
            raise StoreError(f"{root}: cannot write the run store: {e.strerror or e}") from None

    @contextlib.contextmanager
    def _locked(self, exclusive: bool) -> Iterator[None]:
        fd = os.open(self.root / "lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            yield
        finally:
            os.close(fd)

    def entry(self, key: RunKey) -> Path:
        return self.root / "runs" / key.digest

    # --- reading ---------------------------------------------------------------------------------

    def get(self, key: RunKey, dest: Path) -> StoredRun | None:
        """The run stored under ``key`` copied to ``dest`` (missing, or an empty folder), every
        file's checksum verified first; None when there is none or it is not whole (a line on
        stderr says why, and ``dest`` is left as it was)."""
        if not key.reusable:
            unread = [f for f, state in key.facts["environment"]["code"].items() if state is None]
            print(f"parity: the run store is not used: {', '.join(unread)} holds more code or "
                  f"files than its key reads ({MAX_CODE_FILES} entries, {MAX_CODE_BYTES >> 20} "
                  "MiB)", file=sys.stderr)  # fmt: skip
            return None
        entry = self.entry(key)
        with self._locked(exclusive=False):
            if not entry.is_dir():
                return None
            try:
                meta = json.loads((entry / "stored.json").read_text())
                problem = _verify(entry / "run", meta["files"])
            except (OSError, ValueError, KeyError, TypeError) as e:
                problem = f"stored.json unreadable: {e}"
            if problem:
                print(f"parity: not reusing the stored run {entry}: {problem}; removed from "
                      "the store", file=sys.stderr)  # fmt: skip
            else:  # copied while no command adds or evicts: what is copied is what was verified
                shutil.copytree(entry / "run", dest, symlinks=True, dirs_exist_ok=True)
                with contextlib.suppress(OSError):
                    os.utime(entry / "stored.json")  # recently used: evicted last
        if problem:  # never read again: the run made in its place is stored instead
            self.forget(key)
            return None
        return StoredRun(dest, key, meta)

    # --- adding and evicting ---------------------------------------------------------------------

    def put(self, key: RunKey, run_dir: Path, meta: Mapping[str, Any]) -> bool:
        """Store the finished run in ``run_dir`` under ``key`` (a copy; ``meta`` goes into
        stored.json: rev, commit, seconds); False when the key is stored already. Then evict the
        least recently used runs past ``max_bytes``."""
        if not key.reusable or self.entry(key).exists():
            return False
        staging = self.root / "tmp" / f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            shutil.copytree(run_dir, staging / "run", symlinks=True)
            write_json_atomic(staging / "key.json", key.facts)
            files = _checksums(staging / "run")
            stored = {**meta, "files": files, "stored_at": time.time(), "key": key.digest}
            write_json_atomic(staging / "stored.json", stored)  # last: the entry is whole
            with self._locked(exclusive=True):
                try:
                    os.rename(staging, self.entry(key))
                except OSError:  # stored meanwhile by another command: theirs stays
                    return False
                self._evict(keep=key.digest)
                self._sweep()
            return True
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    def _evict(self, keep: str) -> None:
        """Under the exclusive lock: the least recently used runs removed until the store fits
        (each renamed into tmp/ first, so no reader ever sees half of one)."""
        entries = []
        for entry in (self.root / "runs").iterdir():
            with contextlib.suppress(OSError):
                entries.append(((entry / "stored.json").stat().st_mtime, entry, _size(entry)))
        total = sum(size for *_, size in entries)
        for _, entry, size in sorted(entries):
            if total <= self.max_bytes:
                break
            if entry.name == keep:
                continue
            gone = self.root / "tmp" / f"evicted-{entry.name}-{uuid.uuid4().hex[:8]}"
            os.rename(entry, gone)
            shutil.rmtree(gone, ignore_errors=True)
            total -= size

    def _sweep(self) -> None:
        """Under the exclusive lock: staging folders of commands that are gone (killed mid-copy)."""
        for staged in (self.root / "tmp").iterdir():
            pid = staged.name.split("-", 1)[0]
            if not (pid.isdigit() and Path(f"/proc/{pid}").exists()):
                shutil.rmtree(staged, ignore_errors=True)

    def forget(self, key: RunKey) -> None:
        """Remove the run under ``key`` (one that turned out stale)."""
        with self._locked(exclusive=True):
            entry = self.entry(key)
            if entry.is_dir():
                gone = self.root / "tmp" / f"evicted-{entry.name}-{uuid.uuid4().hex[:8]}"
                os.rename(entry, gone)
                shutil.rmtree(gone, ignore_errors=True)


def _checksums(folder: Path) -> dict[str, list]:
    """Every file under ``folder`` (relative path) -> [size, sha256]; a link -> ["link", target]."""
    found: dict[str, list] = {}
    for path in sorted(folder.rglob("*")):
        rel = path.relative_to(folder).as_posix()
        if path.is_symlink():
            found[rel] = ["link", os.readlink(path)]
        elif path.is_file():
            found[rel] = [path.stat().st_size, _sha256(path)]
    return found


def _verify(folder: Path, files: Mapping[str, list]) -> str:
    """'' when ``folder`` holds exactly ``files`` with their checksums, else what differs."""
    if not folder.is_dir():
        return "its run folder is missing"
    found = _checksums(folder)
    if extra := sorted(set(found) - set(files)):
        return f"{extra[0]}: not among the files it was stored with"
    for rel, want in files.items():
        if rel not in found:
            return f"{rel}: missing"
        if found[rel] != list(want):
            return f"{rel}: changed since it was stored (checksum)"
    return ""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and not p.is_symlink())
