"""Where each rank of a hung job waits: its Python stacks, taken before the job is killed, and
one line that names, per rank, the job's own line it is stuck at (the running layer).

Every rank (and the plain job of a launch without torchrun) registers, through the start-up hook
(parity/rank/sitehook), a faulthandler dump of all its threads on ``STACK_SIGNAL``, a real-time
signal no library installs a handler for (SIGUSR1 is Lightning's and Slurm's requeue signal),
into ``<launch>/stacks/<host>-<pid>.txt``. ``collect`` sends it to each rank that has the
handler (a process without it is left alone: the signal's default would kill it), waits for the
dumps, names them ``rank<N>.txt`` and returns the summary line:

    rank 0 waits in all_reduce at train.py:214 (inside rec.log); rank 1 in barrier at
    train.py:240

A job that installs its own handler for that signal keeps it (the hook registers nothing then).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from parity.run import world

STACKS_DIR_ENV, STACK_SIGNAL_ENV = "PARITY_STACKS_DIR", "PARITY_STACK_SIGNAL"
#: set for a launch without torchrun: its one process (not a rank) registers the dump too
STACKS_PLAIN_ENV = "PARITY_STACKS_PLAIN"
STACK_SIGNAL = int(signal.SIGRTMIN) + 6
#: how long the ranks get to write their dumps
DUMP_WAIT_S = 2.0

_FRAME = re.compile(r'^\s+File "(?P<file>.*)", line (?P<line>\d+) in (?P<func>.*)$')
_THREAD = re.compile(r"^(Current thread|Thread) 0x[0-9a-f]+")
_PARITY = str(Path(__file__).resolve().parents[1])  # this package's folder
_RECORD = os.path.join(_PARITY, "record")
#: a file of a library, not the job's own code
_LIBRARY = ("/site-packages/", "/dist-packages/", "/lib/python3")
#: torch.distributed functions that are only wrappers around the one the job called
_WRAPPERS = {"wrapper", "inner", "_fn"}


def stacks_env(stacks_dir: Path, plain: bool = False) -> dict[str, str]:
    """The variables that make the start-up hook register the dump: its folder and signal."""
    env = {STACKS_DIR_ENV: str(stacks_dir), STACK_SIGNAL_ENV: str(STACK_SIGNAL)}
    return {**env, STACKS_PLAIN_ENV: "1"} if plain else env


@dataclass
class Frame:
    file: str
    line: int
    func: str

    @property
    def where(self) -> str:
        return f"{os.path.basename(self.file)}:{self.line}"


def threads(dump: str) -> list[list[Frame]]:
    """Each thread's frames in a faulthandler dump, the innermost first."""
    found: list[list[Frame]] = []
    for text_line in dump.splitlines():
        if _THREAD.match(text_line):
            found.append([])
        elif found and (m := _FRAME.match(text_line)):
            found[-1].append(Frame(m["file"], int(m["line"]), m["func"]))
    return [frames for frames in found if frames]


def main_thread(dump: str) -> list[Frame]:
    """The frames of the thread that runs the job: the one not started by threading (whose
    outermost frame is not threading's bootstrap), else the first."""
    every = threads(dump)
    for frames in every:
        if not any(f.file.endswith("threading.py") for f in frames):
            return frames
    return every[0] if every else []


def _library(frame: Frame) -> bool:
    path = frame.file.replace(os.sep, "/")
    return (
        frame.file.startswith("<")
        or any(part in path for part in _LIBRARY)
        or frame.file.startswith(_PARITY + os.sep)
    )


def _collective(frames: list[Frame]) -> Frame | None:
    """The outermost torch.distributed function on the stack that the job called (all_reduce,
    barrier, ...), its wrappers skipped."""
    found = None
    for frame in frames:
        path = frame.file.replace(os.sep, "/")
        if "/torch/distributed/" in path and frame.func not in _WRAPPERS:
            if not frame.func.startswith("_"):
                found = frame
    return found


def _recorder(frames: list[Frame]) -> Frame | None:
    """The outermost frame of the recorder (parity.record): the call the job made into it."""
    found = None
    for frame in frames:
        if frame.file.startswith(_RECORD + os.sep) and not frame.func.startswith(("_", "<")):
            found = frame
    return found


def where(frames: list[Frame]) -> str:
    """What one rank's main thread waits in, and where in the job's own code, as it reads after
    "waits": "in all_reduce at train.py:214 (inside rec.log)"; outside torch.distributed, the
    job's line and its source ("at train.py:88 in main: time.sleep(60)": a builtin such as
    time.sleep has no frame of its own); the innermost frame when none is the job's."""
    if not frames:
        return "with no Python frame"
    own = next((f for f in frames if not _library(f)), None)
    collective, recorder = _collective(frames), _recorder(frames)
    at = own if own is not None else frames[0]
    if collective is not None:
        text = f"in {collective.func} at {at.where}"
    else:
        source = _source(at)
        text = f"at {at.where} in {at.func}" + (f": {source}" if source else "")
    if recorder is not None:
        text += f" (inside rec.{recorder.func})"
    return text


def _source(frame: Frame, width: int = 60) -> str:
    """The frame's line of source, shortened, or '' when the file is not here."""
    import linecache

    text = linecache.getline(frame.file, frame.line).split("  #")[0].strip()  # no comment
    return text if len(text) <= width else text[: width - 3] + "..."


def summary(dumps: dict[int, str]) -> str:
    """One line for every rank's dump: ``rank 0 waits in all_reduce at train.py:214 (inside
    rec.log); rank 1 in barrier at train.py:240``; a rank without a dump says so."""
    parts = []
    for rank, dump in sorted(dumps.items()):
        lead = f"rank {rank} waits" if not parts else f"rank {rank}"
        if dump.strip():
            parts.append(f"{lead} {where(main_thread(dump))}")
        else:
            parts.append(f"rank {rank}: no stack (no dump on signal {STACK_SIGNAL})")
    return "; ".join(parts)


def _targets(world_dir: Path | None, plain_pid: int | None) -> dict[int, list[int]]:
    """The processes to ask for a dump, by rank: every rank process on this machine that
    recorded itself in the launch's world folder (parity.run.world: torchrun's, or those a
    plain job started itself, Ray's workers), else the plain job itself. None in a fast path's
    launch (--in-process, warm pools), whose ranks fork the job: theirs would say where the warm
    ranks wait for it, not where the job is."""
    found = _recorded_ranks(world_dir)
    if not found and plain_pid is not None:
        return {0: [plain_pid]}
    return found


def _recorded_ranks(world_dir: Path | None) -> dict[int, list[int]]:
    if world_dir is None or any(Path(world_dir).glob("*/*.json")):
        return {}  # the job runs in processes forked from warm ranks (the fast paths): not asked
    found: dict[int, list[int]] = {}
    host = socket.gethostname()
    for record in world.read_records(world_dir):
        rank = record.env.get("RANK")
        if record.host != host or rank is None or not str(rank).isdigit():
            continue
        found.setdefault(int(rank), []).append(record.pid)
    return found


def catches(pid: int, signum: int) -> bool:
    """Whether process ``pid`` has a handler for ``signum`` (Linux /proc: SigCgt)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    m = re.search(r"^SigCgt:\s*([0-9a-f]+)$", status, re.M)
    return bool(m) and bool(int(m[1], 16) >> (signum - 1) & 1)


def collect(
    stacks_dir: Path,
    world_dir: Path | None = None,
    plain_pid: int | None = None,
    wait_s: float = DUMP_WAIT_S,
) -> tuple[str, list[Path]]:
    """Ask each rank for its stacks (the plain job's, ``plain_pid``, instead), wait up to
    ``wait_s`` for the dumps, keep each as ``stacks_dir/rank<N>.txt``; the summary line and the
    files kept. ('', []) when no rank could be asked."""
    host, asked = socket.gethostname(), {}
    for rank, pids in _targets(world_dir, plain_pid).items():
        for pid in pids:
            if catches(pid, STACK_SIGNAL):
                try:
                    os.kill(pid, STACK_SIGNAL)
                except OSError:
                    continue
                asked[(rank, pid)] = Path(stacks_dir) / f"{host}-{pid}.txt"
    if not asked:
        return "", []
    _wait_written(list(asked.values()), wait_s)
    dumps: dict[int, str] = {}
    kept: list[Path] = []
    for (rank, pid), path in sorted(asked.items()):
        try:
            text = path.read_text(errors="replace")
        except OSError:
            text = ""
        if rank in dumps and not text.strip():
            continue  # a second process of the rank (a fork) with nothing to say
        dumps[rank] = text if rank not in dumps else dumps[rank]
        if text.strip():
            kept.append(_keep(path, rank, pid))
    return summary(dumps), kept


def _wait_written(paths: list[Path], wait_s: float) -> None:
    """Until every file has stopped growing, non-empty, or ``wait_s`` passed."""
    deadline, sizes = time.monotonic() + wait_s, None
    while time.monotonic() < deadline:
        time.sleep(0.1)
        now = [p.stat().st_size if p.exists() else 0 for p in paths]
        if all(now) and now == sizes:
            return
        sizes = now


def _keep(path: Path, rank: int, pid: int) -> Path:
    """The dump under its rank's name (a second process of the rank: with its pid)."""
    for name in (f"rank{rank}.txt", f"rank{rank}-{pid}.txt"):
        target = path.with_name(name)
        try:
            os.link(path, target)
        except FileExistsError:
            continue
        except OSError:
            return path
        path.unlink()
        return target
    return path


def tidy(stacks_dir: Path) -> None:
    """After the launch: the empty per-process files go (no dump was asked of them), and the
    folder when nothing is left in it."""
    folder = Path(stacks_dir)
    if not folder.is_dir():
        return
    for path in folder.glob("*-*.txt"):
        try:
            if path.stat().st_size == 0 and not path.name.startswith("rank"):
                path.unlink()
        except OSError:
            pass
    try:
        folder.rmdir()
    except OSError:
        pass  # something kept in it
