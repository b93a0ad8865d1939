"""`parity check`: one job run on two git revisions, or against a golden file (parity.check)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from parity.cli.common import (
    EXIT_RUN_FAILED,
    TEARDOWN_HELP,
    carry,
    diagnosis,
    exit_code,
    job_arguments,
    one_job,
    policies,
    print_result,
    read_options,
    revision_arguments,
    store,
    trace_argument,
)
from parity.judge.compare import printable
from parity.spec import SpecError


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    check = sub.add_parser(
        "check", help="run one spec on two git revisions (or against a golden file) and compare"
    )
    check.add_argument("--base", help="git revision of side A, e.g. origin/main")
    check.add_argument("--head", help="git revision of side B (default: HEAD)")
    check.add_argument("--golden", help="stored metrics file to compare the current tree with")
    job_arguments(check)
    check.add_argument("--out", default="runs/check", help="run folders and report")
    check.add_argument("--allow-teardown-failure", action="store_true", help=TEARDOWN_HELP)
    trace_argument(check, "revisions")
    revision_arguments(check, "the base")
    check.set_defaults(func=run)
    return check


def run(args: argparse.Namespace) -> int:
    from parity.check import check_golden, check_revisions

    job = one_job(args, "check runs one job spec on both sides")
    out, judged, read = Path(args.out), policies(args), read_options(args)
    if args.golden is not None:
        if args.base or args.head:
            raise SpecError("--golden runs the current tree; it takes no --base or --head")
        if args.carry:
            raise SpecError("--golden runs the current tree as it is; it takes no --carry")
        if args.fresh or args.store or args.run_out:
            raise SpecError("--golden runs the current tree once; it takes no --store, --fresh "
                            "or --run-out")  # fmt: skip
        result = check_golden(
            job, Path(args.golden), out, policies=judged, read=read,
            allow_teardown_failure=args.allow_teardown_failure,
        )  # fmt: skip
        return _print_golden(args, result, out)
    if not args.base:
        raise SpecError("check needs --base REV (and optionally --head REV) or --golden FILE")
    result = check_revisions(
        job, args.base, args.head, out, policies=judged, read=read,
        allow_teardown_failure=args.allow_teardown_failure, carry=carry(args), trace=args.trace,
        store=store(args.store), fresh=args.fresh, run_out=args.run_out,
    )  # fmt: skip
    return _print_check(args, result)


def _print_check(args: argparse.Namespace, result) -> int:
    """A check of two revisions as a pair: --json prints summary.json as written; else the
    table, the diagnosis and the verdict, as `parity pair` prints them."""
    if args.json:
        summary = json.loads((result.dir / "summary.json").read_text())
        print(json.dumps(summary, allow_nan=False))
        return EXIT_RUN_FAILED if result.verdict == "failed" else exit_code(result.comparison)
    print(printable(f"runs: {result.a.dir}  {result.b.dir}  summary: {result.dir / 'summary.md'}"))
    print(printable(f"report: {result.report.with_name('report.html')}  {result.report}"))
    for line in result.stop_notes():
        print(line)
    return print_result(result, False, {"diagnosis": result.diagnosis_dict()})


def _print_golden(args: argparse.Namespace, result, out: Path) -> int:
    """A check of the current tree against a golden file: the comparison, its diagnosis."""
    html = result.report.with_name("report.html")
    if not args.json:
        print(f"runs: {result.a_dir}  {result.b_dir}")
        print(f"report: {html}  {result.report}")
    extra = {"a_rev": result.a_rev, "b_rev": result.b_rev, "out": str(out), "report": str(html)}
    extra["carried"] = result.carried
    extra["diagnosis"] = (
        result.diagnosis.to_dict()
        if result.diagnosis is not None
        else diagnosis(result.a_dir, result.b_dir, result.comparison)
    )
    return print_result(result, args.json, extra)
