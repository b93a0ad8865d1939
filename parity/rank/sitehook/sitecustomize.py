"""Loaded by Python at start-up in every process of a parity launch (this folder is first on the
launch's PYTHONPATH); it records which process group each rank really joined.

Why: a job launched as 2 ranks can train as 2 lone processes (a script that never calls
init_process_group; an accelerate script on CPU without its switch, whose group carries
nothing), and a bug that only shows at 2 ranks passes unseen. Each rank writes
``$PARITY_WORLD_DIR/<host>-<pid>.json`` at start, again each time ``init_process_group``
returns (the group's backend, world size and this process's rank), and, while it runs, how many
collectives went through its groups (every group of more than one rank it is in, ``new_group``'s
included): a group that formed but carried nothing (accelerate on CPU without its switch forms
one, then trains each process alone) is no world either. The count is read from the groups'
sequence numbers by a daemon thread (every 0.2 s until the first collective, then every 5 s),
and again when a group is destroyed, at exit and at ``os._exit``, so a rank that ends without
its exit handlers still leaves the count it had reached. ``parity.run.world`` judges the
records after the launch. The user's code is not touched: ``init_process_group`` and
``destroy_process_group`` are wrapped when torch loads ``torch.distributed.distributed_c10d``,
and a process that never imports torch pays nothing but this file. A sitecustomize this one
shadows is loaded after it.

A rank is a process that starts with LOCAL_RANK set (torchrun's ranks), or, below the launch's
first process, with RANK and WORLD_SIZE set: torch's env contract, set by a launcher before the
interpreter starts, as Ray does for a worker group's actors (verl's RayWorkerGroup gives each
its RANK and WORLD_SIZE in the actor's runtime_env; LOCAL_RANK comes only later, from verl's own
code), so the ranks a plain job starts itself are recorded too. The launch's first process
(torchrun, or the plain job) is never one by RANK and WORLD_SIZE alone (a harness running inside
a launch passes its own on), and what a rank starts is never a rank (PARITY_WORLD_CHILD: a
DataLoader worker inherits its parent's variables).

A rank whose parent is the launch's first process (its torchrun, or the plain job that started
it) also asks the kernel to SIGKILL it when that parent dies (PR_SET_PDEATHSIG), so ranks never
outlive a killed launch.

A rank (and the plain job of a launch without torchrun) also registers a dump of its Python
stacks, every thread's, on the signal the harness names (``PARITY_STACK_SIGNAL``, a real-time
signal no library installs a handler for) into ``$PARITY_STACKS_DIR/<host>-<pid>.txt``
(faulthandler): the harness sends it to each rank before it kills a job that stalled or timed
out, and says where each rank waited (parity.run.stacks).

Standard library only; a failure here never stops the job (the launch then lacks its record,
which the harness reports).
"""

import importlib.machinery
import importlib.util
import json
import os
import socket
import sys

_DIR_ENV, _CHILD_ENV = "PARITY_WORLD_DIR", "PARITY_WORLD_CHILD"
#: the pid of the launch's first Python process (torchrun, or the plain job): ranks it starts
#: die with it
_LAUNCHER_ENV = "PARITY_LAUNCHER_PID"
#: the stacks' folder and signal (parity.run.stacks); the plain job of a launch without torchrun
#: (not a rank) dumps too when _PLAIN_ENV is set
_STACKS_ENV, _STACK_SIGNAL_ENV = "PARITY_STACKS_DIR", "PARITY_STACK_SIGNAL"
_PLAIN_ENV = "PARITY_STACKS_PLAIN"
_C10D = "torch.distributed.distributed_c10d"
_FIRST_POLL_S, _POLL_S = 0.2, 5.0  # the count's polling: until the first collective, after
_record = {}
_state = {"gone": 0, "poller": False}  # collectives of destroyed sub-groups; the thread's start


def _write() -> None:
    path = os.path.join(os.environ[_DIR_ENV], f"{_record['host']}-{_record['pid']}.json")
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(_record, f)
    os.replace(tmp, path)


def _joined(c10d) -> None:
    """After init_process_group returned: the default group as this process sees it."""
    try:
        backend = c10d.get_backend()
        _record["joined"].append(
            {"backend": str(backend), "world_size": c10d.get_world_size(), "rank": c10d.get_rank()}
        )
        _write()
    except Exception:  # noqa: BLE001 - never break the job over its record
        pass


def _carried(group) -> int:
    """Collectives ``group`` carried (its sequence number); 0 for a group of one rank, which
    connects nobody."""
    return 0 if group.size() < 2 else int(group._get_sequence_number_for_group())


def _count(c10d) -> int:
    """Collectives through every group of more than one rank this process is in, the destroyed
    sub-groups' included."""
    world = getattr(c10d, "_world", None)
    groups = list(world.pg_map) if world is not None else [c10d._get_default_group()]
    counts, error = [], None
    for group in groups:
        try:
            counts.append(_carried(group))
        except Exception as e:  # noqa: BLE001 - a backend that keeps no count: the others
            error = e
    if error is not None and not counts:
        raise error
    return _state["gone"] + sum(counts)


def _used(c10d) -> None:
    """Record how many collectives this process's groups have carried so far (written when it
    changed); a process forked from a rank (same record, other pid) writes nothing."""
    lock = _state.get("lock")
    if os.getpid() != _record.get("pid") or lock is None or not lock.acquire(timeout=2):
        return
    try:
        if c10d.is_initialized() and _record["joined"]:
            count = _count(c10d)
            if _record["joined"][-1].get("collectives") != count:
                _record["joined"][-1]["collectives"] = count
                _write()
    except Exception:  # noqa: BLE001 - never break the job over its record
        pass
    finally:
        lock.release()


def _poll(c10d) -> None:
    """The daemon thread: the count while the job runs, often until the first collective."""
    import time

    while True:
        _used(c10d)
        group = _record["joined"][-1] if _record["joined"] else {}
        time.sleep(_POLL_S if group.get("collectives") else _FIRST_POLL_S)


def _start_poller(c10d) -> None:
    if _state["poller"]:
        return
    import threading

    _state["poller"] = True
    threading.Thread(target=_poll, args=(c10d,), name="parity-world", daemon=True).start()


def _destroying(c10d, group) -> None:
    """Before ``destroy_process_group(group)``: the count, and a sub-group's collectives kept
    (it leaves the group map); the default group takes every group with it."""
    world = getattr(getattr(c10d, "GroupMember", None), "WORLD", None)
    _used(c10d)
    try:
        if group is None or group is world:
            _state["gone"] = 0
        elif c10d.is_initialized():
            _state["gone"] += _carried(group)
    except Exception:  # noqa: BLE001
        pass


def _wrap(c10d) -> None:
    import threading

    _state["lock"] = threading.Lock()
    init, destroy = c10d.init_process_group, c10d.destroy_process_group

    def init_process_group(*args, **kwargs):
        result = init(*args, **kwargs)
        _joined(c10d)
        _start_poller(c10d)
        return result

    def destroy_process_group(group=None):
        _destroying(c10d, group)
        with _state["lock"]:  # the poller never reads a group while it is taken apart
            return destroy(group)

    for wrapper, original in ((init_process_group, init), (destroy_process_group, destroy)):
        wrapper.__wrapped__ = original
        wrapper.__doc__ = original.__doc__
    c10d.init_process_group = init_process_group
    c10d.destroy_process_group = destroy_process_group
    import atexit

    atexit.register(_used, c10d)
    _wrap_exit(c10d)


def _wrap_exit(c10d) -> None:
    """``os._exit`` records the count first: it skips the exit handlers."""
    real_exit = os._exit

    def _exit(status):
        _used(c10d)
        real_exit(status)

    _exit.__wrapped__ = real_exit
    _exit.__doc__ = real_exit.__doc__
    os._exit = _exit


class _C10dFinder:
    """A meta-path finder that only wraps the loader of torch's c10d module once found."""

    def find_spec(self, name, path=None, target=None):
        if name != _C10D:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader_exec = spec.loader.exec_module

        def exec_module(module):
            loader_exec(module)
            try:
                _wrap(module)
            except Exception:  # noqa: BLE001
                pass

        spec.loader.exec_module = exec_module
        return spec


def _die_with_launcher() -> None:
    """A rank started by the launch's first process (torchrun, or the plain job): SIGKILL when
    it dies (Linux prctl), so a killed launch leaves no rank behind. Only then: the parent of
    another launcher's worker (a Ray raylet) is left alone, and a parent already gone leaves it
    to the harness's cleanup."""
    if not sys.platform.startswith("linux") or os.environ.get(_LAUNCHER_ENV) != str(os.getppid()):
        return
    import ctypes
    import signal

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0)


def _stacks() -> None:
    """Dump every thread's stack into this process's file in the launch's stacks folder on the
    harness's signal; nothing when the launch names none, or when the signal already has a
    handler or is ignored (a job's own is never replaced)."""
    import signal

    folder, number = os.environ.get(_STACKS_ENV), os.environ.get(_STACK_SIGNAL_ENV)
    if not folder or not number or signal.getsignal(int(number)) != signal.SIG_DFL:
        return
    import faulthandler

    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{socket.gethostname()}-{os.getpid()}.txt")
    _state["stacks"] = f = open(path, "w", encoding="utf-8")  # noqa: SIM115 - open for good
    faulthandler.register(int(number), file=f, all_threads=True, chain=False)


def _start() -> None:
    env = {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK")}
    _record.update(pid=os.getpid(), host=socket.gethostname(), env=env, joined=[])
    _write()
    sys.meta_path.insert(0, _C10dFinder())
    _die_with_launcher()
    _stacks()


def fork_record(world_dir: str) -> None:
    """In a process forked from a rank to run a job of its own (parity's in-process sides and
    warm pools fork one per job): a record of its own from now on, in ``world_dir``, for the
    groups it joins; the parent's record stays as it was."""
    if not _record:
        return  # not a rank: nothing is recorded
    os.makedirs(world_dir, exist_ok=True)
    os.environ[_DIR_ENV] = world_dir
    _record.update(pid=os.getpid(), joined=[])
    _state.update(gone=0, poller=False)
    if "lock" in _state:
        import threading

        _state["lock"] = threading.Lock()
    _write()


def _chain() -> None:
    """Run the sitecustomize this file shadows (a distribution's or a virtualenv's own)."""
    here = os.path.dirname(os.path.abspath(__file__))
    path = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


def _is_rank() -> bool:
    """Whether this process is one of the launch's ranks (the module doc says which)."""
    env = os.environ
    if not env.get(_DIR_ENV) or _CHILD_ENV in env:
        return False
    return "LOCAL_RANK" in env or (_LAUNCHER_ENV in env and "RANK" in env and "WORLD_SIZE" in env)


if _is_rank():
    os.environ[_CHILD_ENV] = str(os.getpid())  # what this rank starts is not a rank
    try:
        _start()
    except Exception:  # noqa: BLE001
        pass
elif os.environ.get(_DIR_ENV) and _LAUNCHER_ENV not in os.environ:
    os.environ[_LAUNCHER_ENV] = str(os.getpid())  # the launch's first process: torchrun
    if os.environ.pop(_PLAIN_ENV, None):  # or the plain job itself (not what it starts)
        try:
            _stacks()
        except Exception:  # noqa: BLE001
            pass
_chain()
