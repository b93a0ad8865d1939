"""Task presets and mutant catalogues that installed packages register (entry points).

A spec's ``task`` is "custom" (run its ``command``) or the name of a preset: a job some package
knows how to start, with keys of its own beside the ones every job has. The harness knows none
by itself; a package registers them, as the reference subject does in ``worker/pyproject.toml``:

    [project.entry-points."llm_parity.tasks"]
    charcount-sft = "worker.presets:SFT"        # a parity.tasks.Task

    [project.entry-points."llm_parity.mutants"]
    charcount = "worker.mutants"                # a module with MUTANTS = {name: (text, apply)}

Third-party metric formats register the same way in ``llm_parity.readers`` (parity.readers).
Entry points are read once per process and only when a preset or mutant is asked for, so a
package that fails to import only fails the specs that name it, with its error. Mutants are
looked up where they are applied, in the ranks (parity.rank.mutants).
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cache
from importlib.metadata import entry_points
from pathlib import Path
from typing import TYPE_CHECKING, Any

from parity.errors import SpecError
from parity.rank import mutants as rank_mutants

if TYPE_CHECKING:
    from parity.spec import JobSpec

TASK_GROUP = "llm_parity.tasks"
CUSTOM = "custom"


@dataclass(frozen=True)
class Task:
    """A preset job: its own keys (with defaults), and how to start it.

    keys: the preset's spec keys and their defaults (a spec may set only these beside the
        keys every job has).
    args: the job's torchrun arguments (``["-m", "pkg.train", ...]``) for one run folder.
    check: raises parity.spec.SpecError (one line) on a spec the job cannot run.
    side_key: the key a bare value of ``parity pair --a VALUE`` sets (e.g. "trainer"), and
        what names a side in progress lines.
    traced: the spec rerun to trace ``step`` (its ops written to ops/) and stop after it,
        resuming from a state the job saved when one is given (parity.run.trace_rerun); raises
        SpecError with the reason when it cannot be. None: the job cannot be asked for a trace.
    preload: the default of its specs' ``preload`` key: modules the job imports first thing, in
        that order, that the fast paths import once per warm rank (parity.rank.warm).
    """

    name: str
    summary: str
    keys: Mapping[str, Any]
    args: Callable[[JobSpec, Path], list[str]]
    check: Callable[[JobSpec], None] | None = None
    side_key: str | None = None
    traced: Callable[[JobSpec, int, Path | None], JobSpec] | None = None
    preload: tuple[str, ...] = ()
    entry: str = field(default="", compare=False)  # where it was registered, for messages


class TaskError(SpecError):
    """A task or mutant catalogue that is not known, or that its package failed to give."""


@cache
def registered() -> dict[str, Task]:
    """Every preset the installed packages register, by name."""
    out: dict[str, Task] = {}
    for ep in entry_points(group=TASK_GROUP):
        try:
            task = ep.load()
        except Exception as e:  # the package's own failure, said with the preset's name
            raise TaskError(f"task {ep.name!r} ({ep.value}) cannot be loaded: "
                            f"{type(e).__name__}: {e}") from None  # fmt: skip
        if not isinstance(task, Task) or task.name != ep.name:
            raise TaskError(f"entry point {ep.name} = {ep.value!r} in {TASK_GROUP} is not a "
                            f"parity.tasks.Task named {ep.name!r}")  # fmt: skip
        if task.name in out or task.name == CUSTOM:
            raise TaskError(f"task {task.name!r} is registered twice ({ep.value})")
        out[task.name] = dataclasses.replace(task, entry=ep.value)
    return out


@cache
def _entry_names() -> frozenset[str]:
    """The names the installed packages register, read once per process as ``registered`` is
    (the scan of every distribution's metadata costs about 10 ms a call, and a spec asks often)."""
    return frozenset(ep.name for ep in entry_points(group=TASK_GROUP))


def names() -> tuple[str, ...]:
    """ "custom" and every registered preset (without loading a broken one: listed anyway)."""
    return (CUSTOM, *sorted(_entry_names()))


def get(name: str) -> Task | None:
    """The preset ``name``, or the Task at ``"module:attribute"`` (a preset no installed package
    registers, e.g. run from a source tree); None for "custom"; TaskError otherwise."""
    if name == CUSTOM:
        return None
    if not isinstance(name, str):
        raise TaskError(f"task must be a string, got {name!r}")
    if ":" in name:
        return _imported(name)
    if name not in _entry_names():
        raise TaskError(
            f"task {name[:80]!r} is not known; known: {', '.join(names())} (a package registers "
            f"presets in the {TASK_GROUP} entry points; e.g. pip install -e ./worker for the "
            "charcount ones)"
        )
    return registered()[name]


@cache
def _imported(reference: str) -> Task:
    module, _, attribute = reference.partition(":")
    try:
        task = getattr(importlib.import_module(module), attribute)
    except (ImportError, AttributeError) as e:
        raise TaskError(f"task {reference!r} cannot be loaded: {type(e).__name__}: {e}") from None
    if not isinstance(task, Task):
        raise TaskError(f"task {reference!r} is not a parity.tasks.Task")
    return dataclasses.replace(task, entry=reference)


def load_catalogue(module: str) -> dict[str, tuple[str, Callable[[], None]]]:
    """MUTANTS of one catalogue module, for the harness (TaskError: it cannot be loaded); the
    lookup is the ranks' own (parity.rank.mutants: its catalogues() and MUTANT_GROUP)."""
    try:
        return rank_mutants.load_catalogue(module)
    except rank_mutants.MutantError as e:
        raise TaskError(str(e)) from None
