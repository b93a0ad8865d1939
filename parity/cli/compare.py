"""`parity compare`: two metric files or run folders, compared (parity.judge.compare)."""

from __future__ import annotations

import argparse
from pathlib import Path

from parity.cli.common import diagnosis, files_read, policies, print_verdict, two_files_arguments
from parity.judge.compare import compare_runs


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    compare = sub.add_parser("compare", help="compare two metric files or run folders")
    two_files_arguments(compare)
    compare.set_defaults(func=run)
    return compare


def run(args: argparse.Namespace) -> int:
    comparison = compare_runs(args.a, args.b, policies(args), **files_read(args))
    extra = {"diagnosis": diagnosis(args.a, args.b, comparison)}
    line = _topology_line(args.a, args.b, comparison.verdict)
    if line:
        extra["topology"] = line
    return print_verdict(comparison, args.json, extra)


def run_folder(path: str) -> Path:
    """The run folder of a metrics file or folder given on the command line."""
    return Path(path) if Path(path).is_dir() else Path(path).parent


def _topology_line(a: str, b: str, verdict: str) -> str:
    """The line saying the two runs ran on different nodes (parity.judge.topology), or ''."""
    from parity.judge import topology

    found = [topology.read(run_folder(p)) for p in (a, b)]
    return topology.line(*found, verdict)
