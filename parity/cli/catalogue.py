"""`parity mutants` and `parity tasks`: what installed packages register (parity.tasks)."""

from __future__ import annotations

import argparse


def add_parsers(sub: argparse._SubParsersAction) -> None:
    mutants = sub.add_parser("mutants", help="list the mutants installed packages register")
    mutants.add_argument("--catalogue", default=None, metavar="MODULE",
                         help="one catalogue module (default: every registered one)")  # fmt: skip
    mutants.set_defaults(func=run_mutants)
    presets = sub.add_parser("tasks", help="list the task presets installed packages register")
    presets.set_defaults(func=run_tasks)


def run_mutants(args: argparse.Namespace) -> int:
    """Every mutant of the registered catalogues (or of --catalogue MODULE)."""
    from parity.rank.mutants import MUTANT_GROUP, catalogues
    from parity.tasks import load_catalogue

    modules = [args.catalogue] if args.catalogue else sorted(catalogues().values())
    rows = [(name, text, mod) for mod in modules for name, (text, _) in load_catalogue(mod).items()]
    if not rows:
        print(f"no mutants: no installed package registers a catalogue in {MUTANT_GROUP}")
    width = max((len(name) for name, _, _ in rows), default=0)
    for name, text, mod in sorted(rows):
        print(f"{name:<{width}}  {text}" + (f"  [{mod}]" if len(modules) > 1 else ""))
    return 0


def run_tasks(args: argparse.Namespace) -> int:
    """The presets installed packages register, each with its own keys and their defaults."""
    from parity.tasks import TASK_GROUP, names, registered

    presets = registered()
    print("custom  run the spec's command (every job's keys only)")
    for name in names()[1:]:
        task = presets[name]
        keys = ", ".join(f"{k}={v!r}" for k, v in task.keys.items())
        side = f"; --a/--b VALUE sets {task.side_key}" if task.side_key else ""
        print(f"{name}  {task.summary} ({task.entry or 'registered'}){side}\n    keys: {keys}")
        if task.preload:  # the default of its specs' preload key
            print(f"    preload: {', '.join(task.preload)}")
    if len(names()) == 1:
        print(f"(no presets: no installed package registers one in {TASK_GROUP})")
    return 0
