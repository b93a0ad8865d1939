"""`parity pair`: run side A and side B of a job and compare them (parity.pair.run_pair)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from parity.cli.common import (
    EXIT_NONDETERMINISTIC,
    TEARDOWN_HELP,
    job_arguments,
    job_from_args,
    key_values,
    policies,
    precision_argument,
    print_result,
    read_options,
    trace_argument,
    verdict_arguments,
)
from parity.judge.compare import printable
from parity.spec import JobSpec, PairSpec, SpecError


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    pair = sub.add_parser(
        "pair",
        help="run a matched pair under torchrun and compare",
        description="Run side A and side B of a job (a spec file, or a preset with --set) one "
        "after the other under torchrun, compare their metrics, write report.html/.md.",
    )
    job_arguments(pair)
    pair.add_argument(
        "--a", action="append", default=[], metavar="KEY=VALUE",
        help="a key of side A only (repeat it); a bare VALUE sets the preset's side key",
    )  # fmt: skip
    pair.add_argument("--b", action="append", default=[], metavar="KEY=VALUE",
                      help="a key of side B only, as --a")  # fmt: skip
    pair.add_argument("--inject-a", action="append", default=[], metavar="MUTANT",
                      help="a mutant applied to side A (repeat it; `parity mutants`)")  # fmt: skip
    pair.add_argument("--inject-b", action="append", default=[], metavar="MUTANT",
                      help="a mutant applied to side B, as --inject-a")  # fmt: skip
    pair.add_argument("--out", default="runs/pair",
                      help="folder for a/, b/, summary.json and the report")  # fmt: skip
    pair.add_argument(
        "--parallel", action="store_true",
        help="with --launcher slurm: each side a job of its own, both at once, on whatever nodes "
        "Slurm gives (default: one allocation, the sides one after the other on the same nodes; "
        "across different nodes only a tolerance verdict is meaningful)",
    )  # fmt: skip
    pair.add_argument("--allow-teardown-failure", action="store_true", help=TEARDOWN_HELP)
    pair.add_argument(
        "--noise-floor",
        action="store_true",
        help="run side A twice first; if the two differ, say the environment is not "
        "deterministic (exit 4) and give the floor per metric instead of judging B",
    )
    pair.add_argument(
        "--in-process",
        action="store_true",
        help="both sides in one torchrun launch (same bits, one start-up; each side its own "
        "mutants); refused with the reason when the sides differ in world size or nodes, or "
        "run a script",
    )
    trace_argument(pair, "a pair")
    precision_argument(pair)
    verdict_arguments(pair)
    pair.set_defaults(func=run)
    return pair


def run(args: argparse.Namespace) -> int:
    from parity.pair import run_pair

    result = run_pair(
        _pair_spec(args),
        Path(args.out),
        policies(args),
        allow_teardown_failure=args.allow_teardown_failure,
        noise_floor=args.noise_floor,
        in_process=args.in_process,
        trace=args.trace,
        at_source_precision=read_options(args)["at_source_precision"],
    )
    html = result.report.with_name("report.html")
    if not args.json:
        summary = result.dir / "summary.md"
        print(printable(f"runs: {result.a.dir}  {result.b.dir}  summary: {summary}"))
        print(printable(f"report: {html}  {result.report}"))  # a path may hold a newline
    extra = {"out": str(result.dir), "report": str(html), "diagnosis": result.diagnosis_dict()}
    if result.trace_rerun is not None:
        extra["trace_rerun"] = result.trace_rerun.to_dict()
    if result.floor is not None:
        extra["noise_floor"] = result.floor.to_dict()
        if not result.floor.deterministic:
            return _print_nondeterministic(result, args.json, extra)
        if not args.json:
            print(result.floor.headline())
    return print_result(result, args.json, extra)


def _pair_spec(args: argparse.Namespace) -> PairSpec:
    """The job (--spec or --task) with its sides: the spec's [a]/[b], then --a/--b, --inject-*."""
    base, sides = job_from_args(args), {"a": {}, "b": {}}
    if isinstance(base, PairSpec):
        base, sides = base.base, {"a": dict(base.a), "b": dict(base.b)}
    for side in ("a", "b"):
        sides[side].update(_side_keys(base, getattr(args, side), f"--{side}"))
        mutants = getattr(args, f"inject_{side}")
        if mutants:
            sides[side]["inject"] = mutants
    return PairSpec(base, sides["a"], sides["b"], source=str(args.spec or "the command line"))


def _side_keys(base: JobSpec, items: list[str], flag: str) -> dict:
    """--a/--b: KEY=VALUE items; a bare VALUE sets the preset's side key (--a legacy)."""
    bare = [item for item in items or [] if "=" not in item]
    keys = key_values([item for item in items or [] if "=" in item], flag)
    if len(bare) > 1:
        raise SpecError(f"{flag} takes one bare value (the preset's side key), got {bare}")
    if bare:
        preset = base.preset
        if preset is None or preset.side_key is None:
            raise SpecError(f"{flag} {bare[0]}: task {base.task!r} has no side key; write "
                            f"{flag} KEY=VALUE")  # fmt: skip
        keys[preset.side_key] = bare[0]
    return keys


def _print_nondeterministic(result, as_json: bool, extra: dict) -> int:
    """A against its repeat A' differed: the environment, not B, is to blame (exit 4)."""
    comparison = result.comparison  # A vs A'; B was not run
    info = {"verdict": result.verdict, "metrics_verdict": comparison.verdict, "b_judged": False}
    if as_json:
        print(json.dumps({**comparison.to_dict(), **extra, **info}, allow_nan=False))
    else:  # the floor table is the diagnosis; report.md/html hold A vs A' in full
        print(result.floor.table())
        print(f"verdict: {result.verdict}")
    return EXIT_NONDETERMINISTIC
