"""`parity`: run matched pairs, compare metric files, write reports, check git revisions.

Exit codes: 0 aligned, 1 diverged, 2 bad input (spec, file, format), 3 a run failed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from parity.compare import Comparison, Policy, compare_frames
from parity.launch import LaunchError
from parity.readers import MetricsError, read_metrics
from parity.report import build_report, write_report
from parity.spec import JobSpec, PairSpec, SpecError, load_spec

EXIT_ALIGNED, EXIT_DIVERGED, EXIT_BAD_INPUT, EXIT_RUN_FAILED = 0, 1, 2, 3


def _policies(items: list[str]) -> dict[str, Policy]:
    out = {}
    for item in items:
        name, sep, text = item.partition("=")
        if not sep or not name:
            raise SpecError(f"--policy expects METRIC=POLICY, got {item!r}")
        out[name] = Policy.parse(text)
    return out


def _report(comparison: Comparison, as_json: bool, extra: dict | None = None) -> int:
    if as_json:
        print(json.dumps({**comparison.to_dict(), **(extra or {})}, allow_nan=False))
    else:
        print(comparison.table())
        print(f"verdict: {comparison.verdict}")
    return EXIT_ALIGNED if comparison.ok else EXIT_DIVERGED


def cmd_pair(args: argparse.Namespace) -> int:
    from parity.runs import run_pair

    if args.spec:
        loaded = load_spec(args.spec)
        pair = (
            loaded
            if isinstance(loaded, PairSpec)
            else PairSpec.from_trainers(loaded, args.a, args.b)
        )
    else:
        base = JobSpec(
            task=args.task,
            world_size=args.world,
            engine=args.engine,
            steps=args.steps,
            seed=args.seed,
            global_batch_size=args.global_batch_size,
            micro_batch_size=None if args.dynamic_bsz else args.micro_batch_size,
            dynamic_bsz=args.dynamic_bsz,
            max_tokens_per_rank=args.max_tokens_per_rank,
            model=args.model,
            timeout_s=args.timeout,
        )
        pair = PairSpec.from_trainers(base, args.a, args.b)
    if args.inject_a or args.inject_b:
        pair = PairSpec(
            pair.base,
            {**pair.a, "inject": args.inject_a or pair.a.get("inject", [])},
            {**pair.b, "inject": args.inject_b or pair.b.get("inject", [])},
        )
    policies = _policies(args.policy)
    result = run_pair(pair, Path(args.out), policies)
    md = write_report(result.a.dir, result.b.dir, result.dir, policies)
    html = md.with_name("report.html")
    if not args.json:
        print(f"runs: {result.a.dir}  {result.b.dir}  summary: {result.dir / 'summary.md'}")
        print(f"report: {html}  {md}")
    return _report(result.comparison, args.json, {"out": str(result.dir), "report": str(html)})


def cmd_compare(args: argparse.Namespace) -> int:
    a = read_metrics(args.a, args.format)
    b = read_metrics(args.b, args.format)
    comparison = compare_frames(
        a,
        b,
        _policies(args.policy),
        allow_missing=args.allow_missing,
        allow_incomplete=args.allow_incomplete,
    )
    return _report(comparison, args.json)


def cmd_report(args: argparse.Namespace) -> int:
    report = build_report(
        args.a,
        args.b,
        _policies(args.policy),
        fmt=args.format,
        allow_missing=args.allow_missing,
        allow_incomplete=args.allow_incomplete,
    )
    md = report.write(Path(args.out))
    html = md.with_name("report.html")
    if args.json:
        return _report(report.comparison, True, {"report": str(html), "report_md": str(md)})
    print(f"report: {html}  {md}")
    print(report.headline())
    return EXIT_ALIGNED if report.comparison.ok else EXIT_DIVERGED


def cmd_check(args: argparse.Namespace) -> int:
    from parity.revisions import check_golden, check_revisions

    loaded = load_spec(args.spec)
    if not isinstance(loaded, JobSpec):
        raise SpecError(f"{args.spec}: check runs one job spec on both sides, not an [a]/[b] pair")
    out, policies = Path(args.out), _policies(args.policy)
    if args.golden is not None:
        if args.base or args.head:
            raise SpecError("--golden runs the current tree; it takes no --base or --head")
        result = check_golden(loaded, Path(args.golden), out, policies=policies)
    elif args.base:
        result = check_revisions(loaded, args.base, args.head, out, policies=policies)
    else:
        raise SpecError("check needs --base REV (and optionally --head REV) or --golden FILE")
    html = result.report.with_name("report.html")
    if not args.json:
        print(f"runs: {result.a_dir}  {result.b_dir}")
        print(f"report: {html}  {result.report}")
    extra = {"a_rev": result.a_rev, "b_rev": result.b_rev, "out": str(out), "report": str(html)}
    return _report(result.comparison, args.json, extra)


def cmd_mutants(args: argparse.Namespace) -> int:
    from parity.inject import load_catalogue

    catalogue = load_catalogue(args.catalogue)
    width = max(map(len, catalogue), default=0)
    for name, (description, _) in sorted(catalogue.items()):
        print(f"{name:<{width}}  {description}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="parity", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    pair = sub.add_parser("pair", help="run a matched pair under torchrun and compare")
    pair.add_argument("--spec", type=Path, help="TOML/YAML job or pair spec")
    pair.add_argument("--task", default="charcount-sft")
    pair.add_argument("--a", default="legacy", help="trainer of side A")
    pair.add_argument("--b", default="worker", help="trainer of side B")
    pair.add_argument("--world", type=int, default=2)
    pair.add_argument("--engine", default="fsdp2")
    pair.add_argument("--steps", type=int, default=20)
    pair.add_argument("--seed", type=int, default=0)
    pair.add_argument("--global-batch-size", type=int, default=16)
    pair.add_argument("--micro-batch-size", type=int, default=4)
    pair.add_argument("--dynamic-bsz", action="store_true")
    pair.add_argument("--max-tokens-per-rank", type=int, default=None)
    pair.add_argument("--model", default=None, help="a local HF model folder")
    pair.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    pair.add_argument("--inject-a", action="append", default=[], metavar="MUTANT")
    pair.add_argument("--inject-b", action="append", default=[], metavar="MUTANT")
    pair.add_argument("--out", required=True)
    pair.set_defaults(func=cmd_pair)

    compare = sub.add_parser("compare", help="compare two metric files or run folders")
    compare.add_argument("a")
    compare.add_argument("b")
    compare.add_argument("--format", choices=["jsonl", "verl-console", "verl-jsonl", "csv"])
    compare.add_argument("--allow-missing", action="store_true")
    compare.add_argument("--allow-incomplete", action="store_true")
    compare.set_defaults(func=cmd_compare)

    report = sub.add_parser("report", help="write report.md and report.html for two runs")
    report.add_argument("a")
    report.add_argument("b")
    report.add_argument("-o", "--out", required=True, help="folder for report.md/report.html")
    report.add_argument("--format", choices=["jsonl", "verl-console", "verl-jsonl", "csv"])
    report.add_argument("--allow-missing", action="store_true")
    report.add_argument("--allow-incomplete", action="store_true")
    report.set_defaults(func=cmd_report)

    check = sub.add_parser(
        "check", help="run one spec on two git revisions (or against a golden file) and compare"
    )
    check.add_argument("--base", help="git revision of side A, e.g. origin/main")
    check.add_argument("--head", help="git revision of side B (default: HEAD)")
    check.add_argument("--golden", help="stored metrics file to compare the current tree with")
    check.add_argument("--spec", type=Path, required=True, help="TOML/YAML job spec")
    check.add_argument("--out", default="runs/check", help="run folders and report")
    check.set_defaults(func=cmd_check)

    mutants = sub.add_parser("mutants", help="list the mutant catalogue")
    mutants.add_argument("--catalogue", default="worker.mutants")
    mutants.set_defaults(func=cmd_mutants)

    for s in (pair, compare, report, check):
        s.add_argument("--policy", action="append", default=[], metavar="METRIC=POLICY")
        s.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (SpecError, MetricsError, ValueError) as e:
        print(f"parity: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except LaunchError as e:
        if getattr(args, "json", False):  # a crashed run is "failed", never aligned or diverged
            print(json.dumps({"verdict": "failed", "error": str(e)}))
        print(f"parity: run failed: {e}", file=sys.stderr)
        return EXIT_RUN_FAILED


if __name__ == "__main__":
    sys.exit(main())
