"""The warm process: each rank of a fast-path launch imports the heavy libraries once, then forks
a fresh child per job, one after the other, before any job module is imported or any process
group exists. Both sides of an in-process pair (the harness side: parity.run.inprocess):

    torchrun ... -m parity.rank.warm [--preload M,N] [--mutants A,B] [--timing FILE] \\
        -m worker.sft --trainer legacy --out runs/a --then -m worker.sft --trainer worker ...

The child runs its side as `python -m MODULE ARGS` runs it (runpy, the interpreter's own exit),
forms its process group on a rendezvous store of its own, and exits; the warm process waits for
it and forks the next. So no state of any module, patch or process group can pass from one side
to the next: each side is a new process, as in a launch of its own. A side that fails stops the
rank, which exits as that side did. A side written `-m parity.rank.mutants --mutants A -m MODULE
...` gets its mutants in its own child only; `--mutants` applies a list to every side. Each child
records the world it joined in a folder of its own (world/side-K), judged side by side. A warm
pool's ranks (parity.rank.serve) fork their jobs with the same `preload`, `run_forked` and
`run_warm`.

`--preload` (the jobs' spec key `preload`, e.g. the charcount presets' worker.boot) names modules
the jobs import first thing; the warm process imports them, in order, before PRELOAD and before
any fork, under the launch's environment, so a job finds them imported as a launch of its own
has by then. One that fails to import ends the rank with one line naming it (exit 2), written
to preload-error.txt beside the timing file (a pool: in its queue), which the harness raises as
a SpecError: never skipped.

Runs in the user's ranks: standard library, torch (imported by `preload` and `_own_store`) and
parity.record only (parity.rank).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import runpy
import signal
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from parity.rank import WORLD_DIR_ENV
from parity.rank.pdeathsig import parent_death_signal
from parity.record.files import write_json_atomic, write_text_atomic

SEPARATOR = "--then"  # between two sides' `-m MODULE ARGS...`
PRELOAD_ERROR = "preload-error.txt"  # a rank's one line when a module of --preload failed

#: imported once by the warm process, before any job: much of a launch's start-up. Only numpy and
#: torch (with the distributed parts jobs use): their import starts no thread under a launch's
#: OMP_NUM_THREADS=1, and reads the environment a launch gives, which no job's code has changed
#: yet. What else a job imports first (transformers, after HF_* defaults of its own) comes
#: through its own preload list, which goes before these
PRELOAD = ("numpy", "torch", "torch.distributed.fsdp", "torch.distributed.tensor")
_STORE_KEY = "parity-fork/{name}/port"  # in torchrun's agent store: where a side's store listens
_kept: list[Any] = []  # the side's own store, alive as long as the child


class _InChild(BaseException):
    """Raised in a freshly forked child: unwinds the warm process's frames up to `main`, which
    then runs the job as the interpreter runs `python -m MODULE` (a BaseException, so that no
    handler of the warm process takes it)."""

    def __init__(self, module: str, args: list[str]):
        super().__init__(module)
        self.module, self.args = module, args


def preload(modules: Sequence[str] = (), report: Path | None = None) -> None:
    """Import the job's own `modules` in order, then PRELOAD, in the warm process; nothing is
    run on them (no op, no thread pool, no process group), so forking afterwards is safe.

    PRELOAD is a convenience (a module missing is left to the job); `modules` the job's list:
    one that fails ends this rank with its one line on stderr and in `report`, exit 2.
    """
    for name in modules:
        try:
            importlib.import_module(name)
        except (Exception, SystemExit) as e:  # noqa: BLE001 - whatever its import raised
            _preload_failed(name, e, report)
    for name in PRELOAD:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)


def _preload_failed(name: str, error: BaseException, report: Path | None) -> NoReturn:
    """Say which module failed and how, in one line (stderr, report/PRELOAD_ERROR); exit 2."""
    said = str(error).strip().splitlines()
    line = f"preload: cannot import {name!r}: {type(error).__name__}" + (
        f": {said[0]}" if said else ""
    )
    if report is not None:
        with contextlib.suppress(OSError):
            write_text_atomic(report / PRELOAD_ERROR, line + "\n")
    print(f"parity: error: {line}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def run_forked(module: str, args: list[str], name: str, logs: Path | None = None) -> dict[str, Any]:
    """Run `-m MODULE ARGS` in a fresh child of this warm process and wait for it; its record
    (module, args, seconds, exitcode: negative for a signal).

    The child is a new process of its own: nothing of an earlier job (a module's state, a
    patch, a process group) can reach it. `name` keys its rendezvous store and world records
    (side-0, job-0003); `logs`: its stdout and stderr go to logs/std*.log instead of the rank's.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:
        _become_job(name, logs)
        raise _InChild(module, args)
    try:
        _, status = os.waitpid(pid, 0)
    except BaseException:  # this process is going: its child goes first
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        raise
    code = os.waitstatus_to_exitcode(status)
    return {"module": module, "args": args, "seconds": time.monotonic() - start, "exitcode": code}


def _become_job(name: str, logs: Path | None) -> None:
    """In the child: die with the warm process, its own logs, world record and store."""
    _die_with_parent()
    if logs is not None:
        _logs_to(logs)
    hook = sys.modules.get("sitecustomize")
    world_dir = os.environ.get(WORLD_DIR_ENV)
    if world_dir and callable(getattr(hook, "fork_record", None)):
        hook.fork_record(os.path.join(world_dir, name))
    _own_store(name)


def _die_with_parent() -> None:
    """SIGKILL this child when the warm process dies (Linux prctl), however it dies."""
    arm = parent_death_signal(os.getppid())
    if arm is not None:
        arm()


def _logs_to(folder: Path) -> None:
    """This process's stdout and stderr (file descriptors 1 and 2) into folder/std*.log."""
    folder.mkdir(parents=True, exist_ok=True)
    for fd, file in ((1, "stdout.log"), (2, "stderr.log")):
        target = os.open(folder / file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(target, fd)
        os.close(target)


def _own_store(name: str) -> None:
    """A rendezvous store of this side's own, as torchrun gives each restart a new one: the job's
    process group then forms there, never on keys an earlier side left in the agent's store.
    Rank 0 listens (on a port the system picks) and says where in the agent's store; the job's
    own rank-0 store shares that server (multi-tenant). Without torchrun's variables: nothing."""
    if "MASTER_PORT" not in os.environ or "RANK" not in os.environ:
        return
    from datetime import timedelta

    from torch.distributed import TCPStore

    addr, rank = os.environ["MASTER_ADDR"], int(os.environ["RANK"])
    world, timeout = int(os.environ["WORLD_SIZE"]), timedelta(minutes=5)
    agent = TCPStore(addr, int(os.environ["MASTER_PORT"]), world, False, timeout)
    key = _STORE_KEY.format(name=name)
    if rank == 0:
        own = TCPStore(addr, 0, world, True, timeout, wait_for_workers=False, multi_tenant=True)
        _kept.append(own)
        agent.set(key, str(own.port))
    port = int(agent.get(key))
    os.environ["MASTER_PORT"] = str(port)
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "False"


def _parse(argv: list[str]) -> tuple[argparse.Namespace, list[tuple[str, list[str]]]]:
    usage = (
        "usage: python -m parity.rank.warm [--preload M,N] [--mutants A,B] [--catalogue M] "
        "[--timing FILE] "
        f"-m MODULE ARGS... {SEPARATOR} -m MODULE ARGS..."
    )
    if "-m" not in argv:
        raise SystemExit(usage)
    split = argv.index("-m")
    parser = argparse.ArgumentParser(prog="python -m parity.rank.warm", usage=usage)
    parser.add_argument("--preload", type=_modules, default=[])
    parser.add_argument("--mutants", default="")
    parser.add_argument("--catalogue", default=None)  # default: every registered catalogue
    parser.add_argument("--timing", type=Path, default=None)
    opts = parser.parse_args(argv[:split])
    sides: list[tuple[str, list[str]]] = []
    rest = argv[split:]
    while rest:
        end = rest.index(SEPARATOR) if SEPARATOR in rest else len(rest)
        side, rest = rest[:end], rest[end + 1 :]
        if len(side) < 2 or side[0] != "-m":
            raise SystemExit(f"error: each side must be -m MODULE ARGS...; got {side[:2]}")
        sides.append((side[1], side[2:]))
    return opts, sides


def _modules(text: str) -> list[str]:
    """--preload's value: module names, comma-separated."""
    return [name for name in text.split(",") if name]


def _run(argv: list[str]) -> int:
    """Each side in a child of its own, one after the other; stop at the first that fails,
    exiting as it did (the launch then names this rank, whose log holds the side's)."""
    opts, sides = _parse(argv)
    if opts.mutants:  # applies to every side: wrap each in parity.rank.mutants
        wrap = ["--mutants", opts.mutants]
        wrap += ["--catalogue", opts.catalogue] if opts.catalogue else []
        sides = [("parity.rank.mutants", [*wrap, "-m", m, *a]) for m, a in sides]
    preload(opts.preload, opts.timing.parent if opts.timing is not None else None)
    timings: list[dict[str, Any]] = []
    for k, (module, args) in enumerate(sides):
        timings.append(run_forked(module, args, f"side-{k}"))
        if opts.timing is not None:
            _write_timing(opts.timing, timings)
        if timings[-1]["exitcode"]:
            return timings[-1]["exitcode"]
    return 0


def _write_timing(timing: Path, sides: list[dict[str, Any]]) -> None:
    """The sides this rank ended, in timing.rank<R>.json; rank 0's also in timing.json."""
    rank = int(os.environ.get("RANK", "0"))
    write_json_atomic(timing.with_name(f"{timing.stem}.rank{rank}.json"), {"sides": sides})
    if rank == 0:
        write_json_atomic(timing, {"sides": sides})


def exit_as(code: int) -> NoReturn:
    """Exit as a child did: its exit code, or killed by its signal."""
    sys.stdout.flush()
    sys.stderr.flush()
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code & 0xFF if code > 0 else 1 if code < 0 else 0)


def run_warm(fn: Callable[[list[str]], int], argv: list[str] | None) -> None:
    """`fn(argv)` as the warm process of a torchrun rank, which exits as its failed child did
    (or 0); a forked child returns from here and runs its job as `python -m MODULE` runs, its
    exit (handlers, finalisation, the exit code of an exception) the interpreter's own."""
    try:
        code = fn(list(sys.argv[1:] if argv is None else argv))
    except _InChild as child:
        job = [child.module, *child.args]
    else:
        exit_as(code)
    # out of the handler: the job runs with no exception of ours as its context
    sys.argv[:] = job
    runpy.run_module(job[0], run_name="__main__", alter_sys=True)


def main(argv: list[str] | None = None) -> None:
    """Run every side in turn as this torchrun rank."""
    run_warm(_run, argv)


if __name__ == "__main__":
    main()
