"""What the commands share: the exit codes, the flags (one vocabulary: the job, reading, policy,
store and carry flags, each defined once), turning those flags into the library's arguments,
and printing a verdict.

A flag's value is parsed here, at the edge, once: policies become ``Policy`` objects, KEY=VALUE
items YAML values, a spec file a ``JobSpec``; the library gets them whole.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from parity.judge.compare import Comparison
from parity.judge.policy import Policy, parse_policies
from parity.readers import DUPLICATE_RULES, FORMATS
from parity.spec import (
    LAUNCHER_KINDS,
    JobSpec,
    PairSpec,
    SpecError,
    check_read_options,
    load_check_options,
    load_policies,
    load_read_options,
    load_spec,
    read_keywords,
)

EXIT_ALIGNED, EXIT_DIVERGED, EXIT_BAD_INPUT, EXIT_RUN_FAILED = 0, 1, 2, 3
EXIT_NONDETERMINISTIC = 4  # pair --noise-floor: side A run twice differed
EXIT_IMPRECISE = 5  # a metric judged exact on a rounded source: within it, but not provably
EXIT_INTERNAL = 70  # EX_SOFTWARE (sysexits.h): a bug of ours, never 1 ("diverged")

TEARDOWN_HELP = (
    "a side that crashes or hangs at exit after complete metrics: still reported, but the "
    "verdict is the metrics' (default: failed, exit 3)"
)


# -- the flags ---------------------------------------------------------------------------------


def job_arguments(parser: argparse.ArgumentParser) -> None:
    """The job to run: a spec file, or a preset with keys, and the flags every job has (named
    as the spec's keys; the older spellings kept as aliases)."""
    parser.add_argument("--spec", type=Path, help="TOML/YAML job or pair spec (parity spec "
                        "--example)")  # fmt: skip
    parser.add_argument("--task", help="a preset instead of a spec (`parity tasks`)")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE",
        help="a key of the job, both sides (repeat it; VALUE read as YAML: 3, true, [a, b])",
    )  # fmt: skip
    parser.add_argument("--world-size", "--world", dest="world", type=int, default=None,
                        help="world_size: ranks in all")  # fmt: skip
    parser.add_argument("--nnodes", type=int, default=None, help="torchrun nodes (this host)")
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help="what progress counts to (a preset trains this many)",
    )
    parser.add_argument("--seed", type=int, default=None, help="a preset's seed")
    parser.add_argument("--timeout-s", "--timeout", dest="timeout", type=float, default=None,
                        help="timeout_s: seconds per run")  # fmt: skip
    parser.add_argument(
        "--launcher", choices=LAUNCHER_KINDS, default=None,
        help="where the torchruns run: local (this machine, default) or slurm (sbatch from "
        "here; the spec's [launcher] table sets nodes, partition, time, sbatch_args)",
    )  # fmt: skip


def two_files_arguments(parser: argparse.ArgumentParser) -> None:
    """compare's and report's: side A and side B, how to read them and how to judge them."""
    parser.add_argument("a", help="side A: a metric file or run folder")
    parser.add_argument("b", help="side B: a metric file or run folder")
    read_arguments(parser, files=True)
    verdict_arguments(parser)


def read_arguments(parser: argparse.ArgumentParser, *, files: bool = False) -> None:
    """How a command reads each side's metrics, the same flags and defaults on every command
    that reads (default: the spec's [read] table where the command has a spec, else
    spec.READ_OPTIONS). ``files``: the two sides are files given on the command line, not runs
    the harness made: a run per side, and two more acceptances (--allow-missing,
    --allow-incomplete)."""
    parser.add_argument("--format", choices=FORMATS, help="default: detected per side")
    parser.add_argument(
        "--run", help="the run to read in a folder holding several (TensorBoard, W&B, MLflow)"
    )
    parser.add_argument(
        "--duplicates",
        choices=DUPLICATE_RULES,
        default=None,
        help="a step logged twice with other values (a restarted run): error (default), or keep "
        "the first or the last and say so",
    )
    parser.add_argument(
        "--allow-skipped",
        action="store_true",
        default=None,
        help="compare although a reader skipped records it could not use (the table says so)",
    )
    precision_argument(parser)
    if not files:
        return
    parser.add_argument("--run-a", help="--run for side A only")
    parser.add_argument("--run-b", help="--run for side B only")
    parser.add_argument(
        "--allow-missing",
        action="store_true",
        help="a metric or step on one side only does not fail the comparison (the table says so)",
    )
    parser.add_argument(
        "--allow-incomplete",
        action="store_true",
        help="compare a run without its end record (killed or still writing)",
    )


def precision_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--at-source-precision", action="store_true", default=None,
        help="judge a metric whose log is rounded (4 decimals) at that precision: 'aligned "
        "at 4 decimals'; without it an exact policy on a rounded log is 'imprecise' (exit 5)",
    )  # fmt: skip


def verdict_arguments(parser: argparse.ArgumentParser) -> None:
    """--policy and --json: how metrics are judged, and the verdict as one JSON object."""
    parser.add_argument(
        "--policy", action="append", default=[], metavar="METRIC=POLICY",
        help="how a metric (or glob) is judged: exact, ulp:K, close:RTOL,ATOL, ignore, or "
        "pieces POLICY@STEPS (repeat it; wins over the spec's [policies])",
    )  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def trace_argument(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument(
        "--no-trace",
        dest="trace",
        action="store_false",
        help=f"do not rerun {what} that diverged on the same batches up to the first "
        "divergent step with every op traced (the first differing op; on by default)",
    )


def revision_arguments(parser: argparse.ArgumentParser, reused: str) -> None:
    """What check and bisect take beside the job and their revisions: the run store and the
    early stop (``reused``: what the store gives them), the reading, carried inputs, policies."""
    store_arguments(parser, reused)
    read_arguments(parser)
    carry_argument(parser)
    verdict_arguments(parser)


def store_arguments(parser: argparse.ArgumentParser, reused: str) -> None:
    """--store and --fresh: the run store (parity.store) and a command that ignores it;
    --run-out: no early stop (parity.run.early)."""
    parser.add_argument(
        "--store",
        help=f"run store: {reused} reused from it where a run of the same tree, spec and "
        "environment is stored, and each run that finished kept there (default: "
        "$PARITY_STORE, else ~/.cache/llm-parity/runs; 'off': none)",
    )
    parser.add_argument(
        "--fresh", action="store_true", help="run everything, whatever the store holds"
    )
    parser.add_argument(
        "--run-out",
        action="store_true",
        help="run every revision to its end (by default one judged against known numbers as "
        "it writes its steps is stopped as soon as it diverges)",
    )


def carry_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--carry", action="append", default=[], metavar="PATH",
        help="a path git ignores (a dataset), copied read-only from this checkout into each "
        "revision's worktree (repeatable; beside the spec's [check] carry)",
    )  # fmt: skip


# -- the flags as the library's arguments ------------------------------------------------------


def policies(args: argparse.Namespace) -> dict[str, Policy]:
    """--policy METRIC=POLICY flags (split on the last '=': a policy has none, a metric name
    may) first, then the spec's [policies] (a flag wins, also over the spec's globs)."""
    given: dict[str, str] = {}
    for item in args.policy:
        name, sep, text = item.rpartition("=")
        if not sep or not name:
            raise SpecError(f"--policy expects METRIC=POLICY, got {item[:200]!r}")
        given[name] = text
    parsed = parse_policies(given, "--policy")
    spec = getattr(args, "spec", None)
    if spec is None:
        return parsed
    return {**parsed, **{k: v for k, v in load_policies(spec).items() if k not in parsed}}


def read_options(args: argparse.Namespace) -> dict[str, Any]:
    """How each side is read and what its comparison accepts (spec.READ_OPTIONS' keys): the
    spec's [read] table where the command has a spec, then the flags given."""
    read = load_read_options(getattr(args, "spec", None))
    given = {key: getattr(args, key, None) for key in read}
    return check_read_options({**read, **{k: v for k, v in given.items() if v is not None}},
                              "the command line")  # fmt: skip


def files_read(args: argparse.Namespace) -> dict[str, Any]:
    """compare_runs' and build_report's keywords for two files given on the command line
    (read_arguments with ``files``): ``read_options``, a side's own --run-a/--run-b first."""
    keywords = read_keywords(read_options(args))
    for side in ("a", "b"):
        keywords[f"run_{side}"] = getattr(args, f"run_{side}") or keywords[f"run_{side}"]
    return {**keywords, "allow_missing": args.allow_missing,
            "allow_incomplete": args.allow_incomplete}  # fmt: skip


def job_from_args(args: argparse.Namespace) -> JobSpec | PairSpec:
    """The job of --spec FILE or --task NAME, with --set KEY=VALUE and the generic flags over it."""
    if args.spec and args.task:
        raise SpecError("give --spec FILE or --task NAME, not both")
    if not args.spec and not args.task:
        raise SpecError("give --spec FILE (a job or pair spec) or --task NAME (a preset: "
                        "`parity tasks` lists them)")  # fmt: skip
    changes = key_values(args.set, "--set")
    flags = {"world_size": args.world, "nnodes": args.nnodes, "steps": args.steps,
             "seed": args.seed, "timeout_s": args.timeout}  # fmt: skip
    changes.update({k: v for k, v in flags.items() if v is not None})
    if args.task:
        job = JobSpec.from_dict({"task": args.task, **changes}, "the command line")
        return _with_launcher(job, args, "the command line")
    loaded = load_spec(args.spec)
    base = loaded if isinstance(loaded, JobSpec) else loaded.base
    if changes:
        base = _change(base, changes, f"{args.spec} with --set")
    base = _with_launcher(base, args, f"{args.spec} with --launcher")
    if isinstance(loaded, JobSpec):
        return base
    return PairSpec(base, loaded.a, loaded.b, loaded.source)


def one_job(args: argparse.Namespace, what: str) -> JobSpec:
    """The job of a command that runs one (``job_from_args``), the same on every revision."""
    loaded = job_from_args(args)
    if not isinstance(loaded, JobSpec):
        raise SpecError(f"{args.spec}: {what}, not an [a]/[b] pair")
    return loaded


def _launcher_change(args: argparse.Namespace, spec: JobSpec) -> dict | None:
    """--launcher KIND and --parallel over the spec's [launcher] table (None: neither given)."""
    kind, parallel = getattr(args, "launcher", None), getattr(args, "parallel", False)
    if kind is None and not parallel:
        return None
    table = spec.launcher.to_dict()
    if kind is not None and kind != table.get("kind", "local"):
        table = {"kind": kind}  # another kind's keys do not carry over
    if parallel:
        table["parallel"] = True
    return table


def _with_launcher(spec: JobSpec, args: argparse.Namespace, source: str) -> JobSpec:
    """The spec with --launcher (and pair's --parallel) over its [launcher] table."""
    table = _launcher_change(args, spec)
    return spec if table is None else _change(spec, {"launcher": table}, source)


def _change(spec: JobSpec, changes: dict, source: str) -> JobSpec:
    try:
        return spec.replace(**changes)
    except SpecError as e:
        raise SpecError(f"{source}: {e}") from None


def key_values(items: list[str], flag: str) -> dict:
    """KEY=VALUE items, each VALUE read as YAML (numbers, true/false, null, [lists], {tables})."""
    import yaml

    out = {}
    for item in items or []:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise SpecError(f"{flag} expects KEY=VALUE, got {item[:200]!r}")
        try:
            out[key] = yaml.safe_load(text) if text else ""
        except (yaml.YAMLError, ValueError) as e:  # ValueError: int() of 5000 digits
            first = str(e).strip().splitlines()[0]
            raise SpecError(f"{flag} {key}: cannot read {text[:100]!r}: {first}") from None
    return out


def store(value: str | None):
    """The run store --store names ('off': none), else $PARITY_STORE's, else the cache's."""
    from parity.store import RunStore, default_store

    folder = default_store() if value is None else None if value == "off" else Path(value)
    return None if folder is None else RunStore(folder)


def carry(args: argparse.Namespace) -> list:
    """The paths check and bisect copy into each worktree: the spec's [check] carry, then
    --carry; each named by where it was given, for its error."""
    from parity.carry import carry_items

    from_spec = load_check_options(args.spec)["carry"]
    return [
        *carry_items(from_spec, f"{args.spec}: [check] carry"),
        *carry_items(args.carry, "--carry"),
    ]


# -- printing a verdict ------------------------------------------------------------------------


def exit_code(comparison: Comparison) -> int:
    """The metrics verdict's exit code: 0 aligned, 1 diverged, 5 imprecise."""
    codes = {"aligned": EXIT_ALIGNED, "imprecise": EXIT_IMPRECISE}
    return codes.get(comparison.verdict, EXIT_DIVERGED)


def print_verdict(comparison: Comparison, as_json: bool, extra: dict | None = None) -> int:
    """The table, the diagnosis and the verdict (or one JSON object); the verdict's exit code."""
    if as_json:
        print(json.dumps({**comparison.to_dict(), **(extra or {})}, allow_nan=False))
    else:
        print(comparison.table())
        for line in (extra or {}).get("diagnosis", {}).get("lines", []):  # parity.judge.diagnose
            print(f"diagnosis: {line}")
        if (extra or {}).get("topology"):
            print(f"topology: {extra['topology']}")
        print(f"verdict: {comparison.verdict_text()}")
    return exit_code(comparison)


def print_teardown(result, as_json: bool, extra: dict) -> int:
    """A side finished training, then crashed or hung at exit: say so, with the metrics verdict
    (for `pair` and `check`: their results name the sides, the verdict and the teardown line).

    Exit 3 ("failed", reason teardown-crash/-hang) unless --allow-teardown-failure, which gives
    the metrics verdict's code; the teardown failure is printed and in --json either way.
    """
    comparison = result.comparison
    teardown = [{"side": side, **r.to_dict()} for side, r in result.teardown]
    info = {"verdict": result.verdict, "metrics_verdict": comparison.verdict, "teardown": teardown}
    if as_json:
        print(json.dumps({**comparison.to_dict(), **extra, **info}, allow_nan=False))
    else:
        allowed = "" if result.verdict == "failed" else " (teardown failure allowed)"
        print(comparison.table())
        print(result.teardown_line())
        print(f"verdict: {result.verdict}{allowed}")
    if result.verdict == "failed":
        return EXIT_RUN_FAILED
    return exit_code(comparison)


def print_result(result, as_json: bool, extra: dict) -> int:
    """A comparison of two runs the harness made (pair, check): its verdict, or its teardown."""
    if not result.teardown:
        return print_verdict(result.comparison, as_json, extra)
    return print_teardown(result, as_json, extra)


def diagnosis(a, b, comparison: Comparison) -> dict:
    """parity.judge.diagnose of two run folders (or metric files in them), as JSON-able lines."""
    from parity.judge.diagnose import diagnose

    return diagnose(a, b, comparison).to_dict()
