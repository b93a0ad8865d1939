"""The world a job really ran in: which process group each rank joined (the running layer).

Every launch puts ``parity/rank/sitehook`` first on its processes' PYTHONPATH; its sitecustomize
writes one record per rank process (``<host>-<pid>.json`` in the launch's ``world/`` folder):
torchrun's ranks (LOCAL_RANK set), and the ranks a plain job (``distributed = false``) starts
itself, which a launcher gave RANK and WORLD_SIZE before their interpreter started (Ray's worker
actors in verl's PPO trainer; a script's own subprocesses), never the plain job itself. It
writes when the process starts, each time ``init_process_group`` returns, and while it runs
with how many collectives its groups carried. ``judge`` reads them after the launch: a side
whose ranks did not form one group of the requested size, where two processes claim one rank,
or whose groups carried nothing (or left no count to show they carried anything) did not run
the job that was asked for, whatever its metrics say, and is failed.

Why not trust the manifest: a job writes what it believes; an accelerate script that never
initialised its process group believes it is rank 0 of a world of one, in every process.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from parity.rank import HOOK_DIR, WORLD_DIR_ENV

#: what a process group's absence most often means, by the launcher's words (said once)
_HINT = (
    "for accelerate on CPU set ACCELERATE_USE_CPU=true (spec [env]); a script of your own must "
    "call torch.distributed.init_process_group"
)


@dataclass
class RankRecord:
    """One rank process: its launcher's variables for it (RANK, LOCAL_RANK, WORLD_SIZE,
    GROUP_RANK), and every group it joined (usually one)."""

    host: str
    pid: int
    env: dict[str, str | None]
    joined: list[dict] = field(default_factory=list)

    @property
    def group(self) -> dict | None:
        """The last group it joined (a job may destroy and re-create its group)."""
        return self.joined[-1] if self.joined else None


def launch_env(world_dir: Path, env: dict[str, str]) -> dict[str, str]:
    """``env`` with the hook first on PYTHONPATH and the folder its records go to."""
    world_dir.mkdir(parents=True, exist_ok=True)
    path = [str(HOOK_DIR), *filter(None, [env.get("PYTHONPATH")])]
    return {**env, "PYTHONPATH": os.pathsep.join(path), WORLD_DIR_ENV: str(world_dir)}


def read_records(world_dir: Path) -> list[RankRecord]:
    """Every rank's record in ``world_dir`` (an unreadable one is skipped: it is then missing)."""
    records = []
    for path in sorted(Path(world_dir).glob("*.json")):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            records.append(
                RankRecord(str(data["host"]), int(data["pid"]), dict(data["env"]), data["joined"])
            )
        except (OSError, ValueError, KeyError, TypeError, RecursionError):
            continue
    return records


def used(world_dir: Path) -> bool:
    """Whether some rank's record already shows a collective through its group: a run may then
    be stopped early (parity.run.early) and still be judged whole by ``judge``; until then it
    runs on, so that a world that never carries anything is failed, never stopped as diverged."""
    groups = [r.group for r in read_records(world_dir)]
    return _carried([g.get("collectives") for g in groups if isinstance(g, dict)])


def _carried(counts: list) -> bool:
    """Whether some rank's count of collectives (an integer where it was written) is above 0."""
    return any(isinstance(c, int) and not isinstance(c, bool) and c > 0 for c in counts)


def judge(world_dir: Path, world_size: int) -> str:
    """'' when ``world_size`` rank processes formed one group of that size, each with its own
    rank, and used it (a world of 1: one process, group or not); else one line saying what
    formed instead. Used: some rank's count of collectives (through any of its groups of more
    than one rank, sub-groups included) is above 0. A group whose ranks left no count above 0,
    some none at all (a rank killed or ended by a bare ``_exit`` before its count was written),
    is failed too: that it carried anything is unproven."""
    records = read_records(world_dir)
    started = len(records)
    if started == 0:
        return (
            f"no rank recorded the world it joined (expected {world_size}); is PYTHONPATH "
            "replaced by the job? (parity puts its start-up hook first on it)"
        )
    if world_size == 1:  # one process: a group of one is optional, and carries nothing
        return "" if started == 1 else f"{started} processes started for a world of 1"
    groups = [r.group for r in records]
    lone = sum(g is None for g in groups)
    if lone == started:
        return (
            f"{started} processes launched, none joined a process group (each ran alone); {_HINT}"
        )
    if lone:
        return (
            f"{started} processes launched, {lone} never joined a process group (ran alone); "
            f"{_HINT}"
        )
    claimed = Counter(g["rank"] for g in groups if g is not None)
    twice = ", ".join(f"rank {r} claimed by {n} processes" for r, n in claimed.items() if n > 1)
    sizes = sorted({g["world_size"] for g in groups if g is not None})
    if sizes != [world_size]:
        return (
            f"{started} processes joined process groups of size {', '.join(map(str, sizes))}, "
            f"not one group of {world_size}" + (f" ({twice})" if twice else "")
        )
    if twice:
        return f"{started} processes launched, ranks claimed twice: {twice}"
    unused = _unused(started, world_size, [g.get("collectives") for g in groups if g])
    if unused:
        return unused
    if started != world_size:
        return f"only {started} of {world_size} ranks recorded the group they joined"
    return ""


def _unused(started: int, world_size: int, counts: list) -> str:
    """The line for a group no rank's count shows used: all counts 0, or some missing."""
    if _carried(counts):
        return ""
    missing = sum(not isinstance(c, int) for c in counts)
    if not missing:
        return (
            f"{started} processes joined a process group of {world_size}, but none sent anything "
            f"through it (each trained alone); {_HINT}"
        )
    return (
        f"{started} processes joined a process group of {world_size}, but none left a record of "
        f"using it ({missing} rank(s) ended before their count of collectives was written, "
        "e.g. killed or by a bare _exit): that it carried anything is unproven"
    )
