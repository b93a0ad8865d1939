"""`parity`: run matched pairs, compare metric files, list mutants.

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
    result = run_pair(pair, Path(args.out), _policies(args.policy))
    if not args.json:
        print(f"runs: {result.a.dir}  {result.b.dir}  summary: {result.dir / 'summary.md'}")
    return _report(result.comparison, args.json, {"out": str(result.dir)})


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

    mutants = sub.add_parser("mutants", help="list the mutant catalogue")
    mutants.add_argument("--catalogue", default="worker.mutants")
    mutants.set_defaults(func=cmd_mutants)

    for s in (pair, compare):
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
        print(f"parity: run failed: {e}", file=sys.stderr)
        return EXIT_RUN_FAILED


if __name__ == "__main__":
    sys.exit(main())
