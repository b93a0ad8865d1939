"""Loaded by Python at start-up in every process of a parity launch (this folder is first on the
launch's PYTHONPATH); it records which process group each rank really joined.

Why: a job launched as 2 ranks can train as 2 lone processes (a script that never calls
init_process_group; an accelerate script on CPU without its switch, whose group carries
nothing), and a bug that only shows at 2 ranks passes unseen. Each rank torchrun started
(LOCAL_RANK set) writes
``$PARITY_WORLD_DIR/<host>-<pid>.json`` at start, again each time ``init_process_group``
returns (the group's backend, world size and this process's rank), and once more when the group
is destroyed or the process exits, with how many collectives went through the group: a group
that formed but carried nothing (accelerate on CPU without its switch forms one, then trains
each process alone) is no world either. ``parity.run.world`` judges the records after the launch.
The user's code is not touched: ``init_process_group`` and ``destroy_process_group`` are wrapped
when torch loads ``torch.distributed.distributed_c10d``, and a process that never imports torch
pays nothing but this file. A sitecustomize this one shadows is loaded after it.

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
_C10D = "torch.distributed.distributed_c10d"
_record = {}


def _write() -> None:
    path = os.path.join(os.environ[_DIR_ENV], f"{_record['host']}-{_record['pid']}.json")
    tmp = f"{path}.tmp"
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


def _used(c10d) -> None:
    """How many collectives the default group has carried so far (its sequence number)."""
    try:
        if c10d.is_initialized() and _record["joined"]:
            count = c10d._get_default_group()._get_sequence_number_for_group()
            _record["joined"][-1]["collectives"] = int(count)
            _write()
    except Exception:  # noqa: BLE001
        pass


def _wrap(c10d) -> None:
    init, destroy = c10d.init_process_group, c10d.destroy_process_group

    def init_process_group(*args, **kwargs):
        result = init(*args, **kwargs)
        _joined(c10d)
        return result

    def destroy_process_group(group=None):
        if group is None or group is getattr(getattr(c10d, "GroupMember", None), "WORLD", None):
            _used(c10d)  # the default group, before it goes
        return destroy(group)

    for wrapper, original in ((init_process_group, init), (destroy_process_group, destroy)):
        wrapper.__wrapped__ = original
        wrapper.__doc__ = original.__doc__
    c10d.init_process_group = init_process_group
    c10d.destroy_process_group = destroy_process_group
    import atexit

    atexit.register(_used, c10d)


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


def _start() -> None:
    env = {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK")}
    _record.update(pid=os.getpid(), host=socket.gethostname(), env=env, joined=[])
    _write()
    sys.meta_path.insert(0, _C10dFinder())


def _chain() -> None:
    """Run the sitecustomize this file shadows (a distribution's or a virtualenv's own)."""
    here = os.path.dirname(os.path.abspath(__file__))
    path = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


if os.environ.get(_DIR_ENV) and "LOCAL_RANK" in os.environ and _CHILD_ENV not in os.environ:
    os.environ[_CHILD_ENV] = str(os.getpid())  # what this rank starts is not a rank
    try:
        _start()
    except Exception:  # noqa: BLE001
        pass
_chain()
