"""`parity report`: report.md and report.html of two runs (parity.report)."""

from __future__ import annotations

import argparse
from pathlib import Path

from parity.cli.common import exit_code, files_read, policies, print_verdict, two_files_arguments
from parity.cli.compare import run_folder
from parity.judge.compare import printable
from parity.report import build_report


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    report = sub.add_parser("report", help="write report.md and report.html for two runs")
    report.add_argument("-o", "--out", default="runs/report",
                        help="folder for report.md/report.html")  # fmt: skip
    two_files_arguments(report)
    report.set_defaults(func=run)
    return report


def run(args: argparse.Namespace) -> int:
    notes = _topology_notes(args.a, args.b)
    report = build_report(args.a, args.b, policies(args), notes=notes, **files_read(args))
    md = report.write(Path(args.out))
    html = md.with_name("report.html")
    if args.json:
        extra = {"report": str(html), "report_md": str(md)}
        if report.diagnosis is not None:
            extra["diagnosis"] = report.diagnosis.to_dict()
        return print_verdict(report.comparison, True, extra)
    print(printable(f"report: {html}  {md}"))  # a path may hold a newline
    print(report.headline())
    for line in report.diagnosis.lines() if report.diagnosis is not None else []:
        print(f"diagnosis: {line}")
    return exit_code(report.comparison)


def _topology_notes(a: str, b: str) -> list[str]:
    """The report's notes on where each run ran (Slurm) and whether that differed."""
    from parity.pair import topology_notes

    return topology_notes(run_folder(a), run_folder(b), "")
