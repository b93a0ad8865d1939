"""The watchdog of one launch: a small process beside the harness that ends the launch's processes
when the harness ends, however it ends (SIGKILL included).

Why: the harness's own cleanup (``parity.run.launch``) runs only while the harness lives, and
finds the launch's processes by the launch id in their environment; a harness killed with SIGKILL
cleans nothing, and a helper the job starts with an empty environment in a session of its own
(``setsid``) carries no launch id. The watchdog holds the read end of a pipe whose write end only
the harness has: end of file means the harness closed it (its cleanup is done) or died. Until
then it scans /proc every ``SCAN_S`` and remembers, by pid and start time, every process of the
launch: the one the harness started, each process carrying the launch id, and each descendant of
one it already knows (by parent pid, caught while the parent lives, so a helper keeps being known
after its parent died; one orphaned before the next scan, by a double fork, has been re-parented
to the launch's root, a child subreaper: parity.rank.pdeathsig.parent_death_signal). At end of
file it SIGKILLs all of them still alive, and whatever they start meanwhile, then exits.

Run as ``python -I -S watchdog.py LAUNCH_ID ROOT_PID`` with the pipe as stdin: standard library
only, Linux /proc only (elsewhere it just waits for the end of file and kills the root).
"""

from __future__ import annotations

import os
import select
import signal
import sys
import time

SCAN_S = 0.25  # how often the launch's processes are looked for while it runs
KILL_S = 10.0  # how long the kill at the end goes on while some still live


def _stat(pid: int) -> tuple[int, int, str] | None:
    """(parent pid, start time, state) of ``pid``, None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read().decode(errors="replace")
        fields = text[text.rindex(")") + 2 :].split()
        return int(fields[1]), int(fields[19]), fields[0]
    except (OSError, ValueError, IndexError):
        return None


def _carries(pid: int, needle: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return needle in f.read().split(b"\0")
    except OSError:
        return False


class Launch:
    """The processes of one launch known so far: pid -> start time."""

    def __init__(self, launch_id: str, root: int):
        self.needle = f"PARITY_LAUNCH_ID={launch_id}".encode()
        self.known: dict[int, int] = {}
        self.seen: set[tuple[int, int]] = set()  # looked at once: not of the launch by its env
        self.skip = {os.getpid(), os.getppid()}
        root_stat = _stat(root)
        if root_stat is not None:
            self.known[root] = root_stat[1]

    def scan(self) -> None:
        """Add every live process of the launch not yet known (parents before children: in
        order of start time)."""
        if not os.path.isdir("/proc/self"):
            return
        found = []
        for name in os.listdir("/proc"):
            if name.isdigit() and int(name) not in self.skip:
                stat = _stat(int(name))
                if stat is not None and stat[2] != "Z":
                    found.append((stat[1], int(name), stat[0]))
        for start, pid, ppid in sorted(found):
            if self.known.get(pid) == start:
                continue
            parent_start = self.known.get(ppid)
            if parent_start is not None and parent_start <= start:
                self.known[pid] = start
            elif (pid, start) not in self.seen:
                self.seen.add((pid, start))
                if _carries(pid, self.needle):
                    self.known[pid] = start

    def alive(self) -> list[int]:
        """The known processes still running as themselves (not a pid reused since)."""
        live = []
        for pid, start in self.known.items():
            stat = _stat(pid)
            if stat is not None and stat[1] == start and stat[2] != "Z":
                live.append(pid)
        return live

    def kill(self) -> None:
        """SIGKILL every known process until none is left (a dying one may still fork)."""
        deadline = time.monotonic() + KILL_S
        while time.monotonic() < deadline:
            self.scan()
            live = self.alive()
            if not live:
                return
            for pid in live:
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            time.sleep(0.05)


def watch(launch_id: str, root: int, stream: int = 0) -> None:
    """Know the launch's processes until ``stream`` ends, then kill them."""
    launch = Launch(launch_id, root)
    while True:
        ready, _, _ = select.select([stream], [], [], SCAN_S)
        if ready and not os.read(stream, 4096):
            break
        launch.scan()
    launch.kill()


if __name__ == "__main__":
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_IGN)  # only the end of its pipe ends it
    watch(sys.argv[1], int(sys.argv[2]))
