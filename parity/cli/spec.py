"""`parity spec`: a spec checked without running it, its launch lines, or the example."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from parity.spec import (
    JobSpec,
    PairSpec,
    SpecError,
    load_check_options,
    load_policies,
    load_read_options,
    load_spec,
)


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    spec = sub.add_parser(
        "spec", help="check a job spec without running it, or print a commented example"
    )
    spec.add_argument("file", nargs="?", type=Path, help="a TOML/YAML spec to check")
    spec.add_argument(
        "--example", action="store_true", help="print a spec with every key and its default"
    )
    spec.add_argument(
        "--command",
        action="store_true",
        help="print each side's command as launched (runs nothing)",
    )
    spec.set_defaults(func=run)
    return spec


def run(args: argparse.Namespace) -> int:
    """Print the commented example spec, or check a spec file and print the job(s) it gives."""
    from parity.spec import EXAMPLE

    if args.example:
        print(EXAMPLE, end="")
        return 0
    if args.file is None:
        raise SpecError("spec needs a FILE to check, or --example")
    loaded = load_spec(args.file)
    load_policies(args.file)
    load_read_options(args.file)
    load_check_options(args.file)
    if args.command:
        return _print_commands(loaded)
    if isinstance(loaded, PairSpec):
        a, b = loaded.sides()
        print(json.dumps({"a": a.shown(), "b": b.shown()}, indent=2))
    else:
        print(json.dumps(loaded.shown(), indent=2))
    return 0


def _print_commands(loaded: JobSpec | PairSpec) -> int:
    """Each side's launch line, `{out}` made OUT/a (a job: OUT), as `pair` would run it here
    (check and bisect: in each revision's worktree, PYTHONPATH on it); nothing is run."""
    from parity.run.job import launch_line

    sides = dict(zip("ab", loaded.sides(), strict=True)) if isinstance(loaded, PairSpec) else {}
    print(f"# in {Path.cwd()} (check, bisect: a worktree of each revision); OUT: --out DIR")
    if not sides:
        print(launch_line(loaded, Path("OUT")))
    for side, spec in sides.items():
        print(f"# side {side}\n{launch_line(spec, Path('OUT') / side)}")
    return 0
