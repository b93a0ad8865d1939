"""`parity`: run matched pairs, compare metric files, write reports, check git revisions.

Exit codes: 0 aligned, 1 diverged, 2 bad input (spec, file, format, a partial read, nothing
compared, a path that cannot be read or written: one line `parity: error: ...`), 3 a run failed,
4 nondeterministic (pair --noise-floor: side A run twice differed), 5 imprecise (a metric judged
exact whose source is rounded: the line names it and its precision), 70 an internal error (a
bug of ours: one line `parity: internal error, please report: ...`, then the traceback). bisect:
1 when it names the first diverging commit, 0 when bad is aligned with good. Stopped by a
signal: 130 (SIGINT), 143 (SIGTERM), 129 (SIGHUP); output into a closed pipe: 141. No other code:
1 is only "diverged".
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import traceback
from pathlib import Path

from parity.errors import InputError
from parity.judge.compare import Comparison, Policy, compare_runs
from parity.readers import DUPLICATE_RULES, FORMATS
from parity.readers.frame import clip_message
from parity.report import build_report
from parity.run.launch import LaunchError
from parity.spec import (
    LAUNCHER_KINDS,
    JobSpec,
    PairSpec,
    SpecError,
    load_check_options,
    load_policies,
    load_read_options,
    load_spec,
)

EXIT_ALIGNED, EXIT_DIVERGED, EXIT_BAD_INPUT, EXIT_RUN_FAILED = 0, 1, 2, 3
EXIT_NONDETERMINISTIC = 4  # pair --noise-floor: side A run twice differed
EXIT_IMPRECISE = 5  # a metric judged exact on a rounded source: within it, but not provably
EXIT_INTERNAL = 70  # EX_SOFTWARE (sysexits.h): a bug of ours, never 1 ("diverged")


def _policies(items: list[str]) -> dict[str, Policy]:
    """METRIC=POLICY, split on the last '=' (a policy has none; a metric name may)."""
    out = {}
    for item in items:
        name, sep, text = item.rpartition("=")
        if not sep or not name:
            raise SpecError(f"--policy expects METRIC=POLICY, got {item[:200]!r}")
        out[name] = Policy.parse(text)
    return out


def _with_spec(policies: dict[str, Policy], spec: Path | None) -> dict[str, Policy | str]:
    """--policy flags first (they win, also over the spec's globs), then the spec's [policies]."""
    if spec is None:
        return dict(policies)
    from_spec = {k: v for k, v in load_policies(spec).items() if k not in policies}
    return {**policies, **from_spec}


def _exit(comparison: Comparison) -> int:
    """The metrics verdict's exit code: 0 aligned, 1 diverged, 5 imprecise."""
    codes = {"aligned": EXIT_ALIGNED, "imprecise": EXIT_IMPRECISE}
    return codes.get(comparison.verdict, EXIT_DIVERGED)


def _report(comparison: Comparison, as_json: bool, extra: dict | None = None) -> int:
    if as_json:
        print(json.dumps({**comparison.to_dict(), **(extra or {})}, allow_nan=False))
    else:
        print(comparison.table())
        for line in (extra or {}).get("diagnosis", {}).get("lines", []):  # parity.judge.diagnose
            print(f"diagnosis: {line}")
        if (extra or {}).get("topology"):
            print(f"topology: {extra['topology']}")
        print(f"verdict: {comparison.verdict_text()}")
    return _exit(comparison)


def cmd_pair(args: argparse.Namespace) -> int:
    base, sides = _job_from_args(args), {"a": {}, "b": {}}
    if isinstance(base, PairSpec):
        base, sides = base.base, {"a": dict(base.a), "b": dict(base.b)}
    for side in ("a", "b"):
        sides[side].update(_side_keys(base, getattr(args, side), f"--{side}"))
        mutants = getattr(args, f"inject_{side}")
        if mutants:
            sides[side]["inject"] = mutants
    pair = PairSpec(base, sides["a"], sides["b"], source=str(args.spec or "the command line"))
    policies = _with_spec(_policies(args.policy), args.spec)
    return _pair(args, pair, policies)


def _job_from_args(args: argparse.Namespace) -> JobSpec | PairSpec:
    """The job of --spec FILE or --task NAME, with --set KEY=VALUE and the generic flags over it."""
    if args.spec and args.task:
        raise SpecError("give --spec FILE or --task NAME, not both")
    if not args.spec and not args.task:
        raise SpecError("give --spec FILE (a job or pair spec) or --task NAME (a preset: "
                        "`parity tasks` lists them)")  # fmt: skip
    changes = _key_values(args.set, "--set")
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


def _one_job(args: argparse.Namespace, what: str) -> JobSpec:
    """The job of check and bisect (``_job_from_args``): one, run on every revision."""
    loaded = _job_from_args(args)
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


def _key_values(items: list[str], flag: str) -> dict:
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


def _side_keys(base: JobSpec, items: list[str], flag: str) -> dict:
    """--a/--b: KEY=VALUE items; a bare VALUE sets the preset's side key (--a legacy)."""
    bare = [item for item in items or [] if "=" not in item]
    keys = _key_values([item for item in items or [] if "=" in item], flag)
    if len(bare) > 1:
        raise SpecError(f"{flag} takes one bare value (the preset's side key), got {bare}")
    if bare:
        preset = base.preset
        if preset is None or preset.side_key is None:
            raise SpecError(f"{flag} {bare[0]}: task {base.task!r} has no side key; write "
                            f"{flag} KEY=VALUE")  # fmt: skip
        keys[preset.side_key] = bare[0]
    return keys


def _pair(args: argparse.Namespace, pair: PairSpec, policies: dict) -> int:
    """`parity pair` after its spec: parity.pair.run_pair does the work, this prints it."""
    from parity.pair import run_pair

    result = run_pair(
        pair,
        Path(args.out),
        policies,
        allow_teardown_failure=args.allow_teardown_failure,
        noise_floor=args.noise_floor,
        in_process=args.in_process,
        trace=args.trace,
        at_source_precision=args.at_source_precision
        or (args.spec is not None and load_read_options(args.spec)["at_source_precision"]),
    )
    html = result.report.with_name("report.html")
    if not args.json:
        print(f"runs: {result.a.dir}  {result.b.dir}  summary: {result.dir / 'summary.md'}")
        print(f"report: {html}  {result.report}")
    extra = {"out": str(result.dir), "report": str(html), "diagnosis": result.diagnosis_dict()}
    if result.trace_rerun is not None:
        extra["trace_rerun"] = result.trace_rerun.to_dict()
    if result.floor is not None:
        extra["noise_floor"] = result.floor.to_dict()
        if not result.floor.deterministic:
            return _report_nondeterministic(result, args.json, extra)
        if not args.json:
            print(result.floor.headline())
    if not result.teardown:
        return _report(result.comparison, args.json, extra)
    return _report_teardown(result, args.json, extra)


def _report_nondeterministic(result, as_json: bool, extra: dict) -> int:
    """A against its repeat A' differed: the environment, not B, is to blame (exit 4)."""
    comparison = result.comparison  # A vs A'; B was not run
    info = {"verdict": result.verdict, "metrics_verdict": comparison.verdict, "b_judged": False}
    if as_json:
        print(json.dumps({**comparison.to_dict(), **extra, **info}, allow_nan=False))
    else:  # the floor table is the diagnosis; report.md/html hold A vs A' in full
        print(result.floor.table())
        print(f"verdict: {result.verdict}")
    return EXIT_NONDETERMINISTIC


def _report_teardown(result, as_json: bool, extra: dict) -> int:
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
    return _exit(comparison)


def _read_options(args: argparse.Namespace, side: str) -> dict:
    """read_metrics' keywords for one side: --run (or --run-a/--run-b) and --duplicates."""
    run = getattr(args, f"run_{side}") or args.run
    return {"run": run, "duplicates": args.duplicates}


def cmd_compare(args: argparse.Namespace) -> int:
    comparison = compare_runs(
        args.a, args.b, _policies(args.policy), fmt=args.format,
        run_a=_read_options(args, "a")["run"], run_b=_read_options(args, "b")["run"],
        duplicates=args.duplicates, allow_missing=args.allow_missing,
        allow_incomplete=args.allow_incomplete, allow_skipped=args.allow_skipped,
        at_source_precision=args.at_source_precision,
    )  # fmt: skip
    extra = {"diagnosis": _diagnosis(args.a, args.b, comparison)}
    line = _topology_line(args.a, args.b, comparison.verdict)
    if line:
        extra["topology"] = line
    return _report(comparison, args.json, extra)


def _run_folder(path: str) -> Path:
    """The run folder of a metrics file or folder given on the command line."""
    return Path(path) if Path(path).is_dir() else Path(path).parent


def _topology_notes(a: str, b: str) -> list[str]:
    """The report's notes on where each run ran (Slurm) and whether that differed."""
    from parity.pair import topology_notes

    return topology_notes(_run_folder(a), _run_folder(b), "")


def _topology_line(a: str, b: str, verdict: str) -> str:
    """The line saying the two runs ran on different nodes (parity.judge.topology), or ''."""
    from parity.judge import topology

    found = [topology.read(_run_folder(p)) for p in (a, b)]
    return topology.line(*found, verdict)


def _diagnosis(a, b, comparison: Comparison) -> dict:
    """parity.judge.diagnose of two run folders (or metric files in them), as JSON-able lines."""
    from parity.judge.diagnose import diagnose

    return diagnose(a, b, comparison).to_dict()


def cmd_report(args: argparse.Namespace) -> int:
    report = build_report(
        args.a,
        args.b,
        _policies(args.policy),
        fmt=args.format,
        allow_missing=args.allow_missing,
        allow_incomplete=args.allow_incomplete,
        allow_skipped=args.allow_skipped,
        at_source_precision=args.at_source_precision,
        read_a=_read_options(args, "a"),
        read_b=_read_options(args, "b"),
        notes=_topology_notes(args.a, args.b),
    )
    md = report.write(Path(args.out))
    html = md.with_name("report.html")
    if args.json:
        extra = {"report": str(html), "report_md": str(md)}
        if report.diagnosis is not None:
            extra["diagnosis"] = report.diagnosis.to_dict()
        return _report(report.comparison, True, extra)
    print(f"report: {html}  {md}")
    print(report.headline())
    for line in report.diagnosis.lines() if report.diagnosis is not None else []:
        print(f"diagnosis: {line}")
    return _exit(report.comparison)


def cmd_check(args: argparse.Namespace) -> int:
    from parity.check import check_golden, check_revisions

    loaded = _one_job(args, "check runs one job spec on both sides")
    out, policies = Path(args.out), _with_spec(_policies(args.policy), args.spec)
    read = _run_read_options(args)
    if args.golden is not None:
        if args.base or args.head:
            raise SpecError("--golden runs the current tree; it takes no --base or --head")
        if args.carry:
            raise SpecError("--golden runs the current tree as it is; it takes no --carry")
        if args.fresh or args.store or args.run_out:
            raise SpecError("--golden runs the current tree once; it takes no --store, --fresh "
                            "or --run-out")  # fmt: skip
        result = check_golden(
            loaded, Path(args.golden), out, policies=policies, read=read,
            allow_teardown_failure=args.allow_teardown_failure,
        )  # fmt: skip
        return _golden_printed(args, result, out)
    if not args.base:
        raise SpecError("check needs --base REV (and optionally --head REV) or --golden FILE")
    pair = check_revisions(
        loaded, args.base, args.head, out, policies=policies, read=read,
        allow_teardown_failure=args.allow_teardown_failure, carry=_carry(args), trace=args.trace,
        store=_store(args.store), fresh=args.fresh, run_out=args.run_out,
    )  # fmt: skip
    return _check_printed(args, pair)


def _store_arguments(parser: argparse.ArgumentParser, reused: str) -> None:
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


def _store(value: str | None):
    """The run store --store names ('off': none), else $PARITY_STORE's, else the cache's."""
    from parity.store import RunStore, default_store

    folder = default_store() if value is None else None if value == "off" else Path(value)
    return None if folder is None else RunStore(folder)


def _check_printed(args: argparse.Namespace, result) -> int:
    """A check of two revisions as a pair: --json prints summary.json as written; else the
    table, the diagnosis and the verdict, as `parity pair` prints them."""
    if args.json:
        summary = json.loads((result.dir / "summary.json").read_text())
        print(json.dumps(summary, allow_nan=False))
        return EXIT_RUN_FAILED if result.verdict == "failed" else _exit(result.comparison)
    print(f"runs: {result.a.dir}  {result.b.dir}  summary: {result.dir / 'summary.md'}")
    print(f"report: {result.report.with_name('report.html')}  {result.report}")
    for line in result.stop_notes():
        print(line)
    extra = {"diagnosis": result.diagnosis_dict()}
    if not result.teardown:
        return _report(result.comparison, False, extra)
    return _report_teardown(result, False, extra)


def _golden_printed(args: argparse.Namespace, result, out: Path) -> int:
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
        else _diagnosis(result.a_dir, result.b_dir, result.comparison)
    )
    if not result.teardown:
        return _report(result.comparison, args.json, extra)
    return _report_teardown(result, args.json, extra)


def _run_read_options(args: argparse.Namespace) -> dict:
    """How check and bisect read each side: the spec's [read] table, then the flags given."""
    read = load_read_options(args.spec)
    given = {
        "format": args.format, "run": args.run, "duplicates": args.duplicates,
        "allow_skipped": args.allow_skipped or None,
        "at_source_precision": getattr(args, "at_source_precision", False) or None,
    }  # fmt: skip
    return {**read, **{k: v for k, v in given.items() if v is not None}}


def _carry(args: argparse.Namespace) -> list:
    """The paths check and bisect copy into each worktree: the spec's [check] carry, then
    --carry; each named by where it was given, for its error."""
    from parity.carry import carry_items

    from_spec = load_check_options(args.spec)["carry"]
    return [
        *carry_items(from_spec, f"{args.spec}: [check] carry"),
        *carry_items(args.carry, "--carry"),
    ]


def cmd_bisect(args: argparse.Namespace) -> int:
    from parity.bisect import bisect

    policies = _with_spec(_policies(args.policy), args.spec)
    read = _run_read_options(args)
    loaded = _one_job(args, "bisect runs one job spec")
    result = bisect(
        loaded, args.good, args.bad, Path(args.out), policies=policies,
        fmt=read["format"], run=read["run"], duplicates=read["duplicates"],
        allow_skipped=read["allow_skipped"], carry=_carry(args), store=_store(args.store),
        fresh=args.fresh, run_out=args.run_out,
    )  # fmt: skip
    if args.json:
        print(json.dumps(result.to_dict(), allow_nan=False))
    else:
        print(result.text())
        print(result.verdict_line())
    return EXIT_ALIGNED if result.verdict == "aligned" else EXIT_DIVERGED


def cmd_onpolicy(args: argparse.Namespace) -> int:
    """Judge a PPO run's on-policy chain; without a run folder, run the PPO job first."""
    from parity.judge.onpolicy import judge_chain, load_chain

    run = Path(args.run) if args.run else _run_onpolicy_job(args)
    result = judge_chain(load_chain(run), max_ulp=args.max_ulp)
    if args.json:
        print(json.dumps({"run": str(run), **result.to_dict()}, allow_nan=False))
    else:
        print(result.table())
        print(f"verdict: {result.verdict()}")
    return EXIT_ALIGNED if result.ok else EXIT_DIVERGED


def _run_onpolicy_job(args: argparse.Namespace) -> Path:
    from parity.run.job import run_job

    spec = _job_from_args(args)
    if isinstance(spec, PairSpec):
        raise SpecError(f"{args.spec}: onpolicy runs one job, not an [a]/[b] pair")
    out = Path(args.out)
    run_job(spec, out, label=f"onpolicy {spec.variant or spec.task}")
    return out


def cmd_spec(args: argparse.Namespace) -> int:
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


def cmd_mutants(args: argparse.Namespace) -> int:
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


def cmd_tasks(args: argparse.Namespace) -> int:
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


def cmd_ci(args: argparse.Namespace) -> int:
    """Print the CI recipe (parity.ci) for the spec, after checking it as `parity spec` does."""
    from parity import ci

    ci.check_spec(args.spec)
    spec, warning = ci.spec_in_repo(args.spec)
    if warning:
        print(f"parity: warning: {warning}", file=sys.stderr)
    given = {"install": args.install, "project_install": args.project_install}
    given["python"] = args.python
    kept = {k: v for k, v in given.items() if v is not None}  # None: the recipe's default
    print(ci.render(spec, args.format, args.base, **kept), end="")
    return 0


_TEARDOWN_HELP = (
    "a side that crashes or hangs at exit after complete metrics: still reported, but the "
    "verdict is the metrics' (default: failed, exit 3)"
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="parity", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    pair = sub.add_parser(
        "pair",
        help="run a matched pair under torchrun and compare",
        description="Run side A and side B of a job (a spec file, or a preset with --set) one "
        "after the other under torchrun, compare their metrics, write report.html/.md.",
    )
    _job_arguments(pair)
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
    pair.add_argument("--allow-teardown-failure", action="store_true", help=_TEARDOWN_HELP)
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
    pair.add_argument(
        "--no-trace",
        dest="trace",
        action="store_false",
        help="do not rerun a pair that diverged on the same batches up to its first divergent "
        "step with every op traced (the first differing op; on by default)",
    )
    pair.set_defaults(func=cmd_pair)

    compare = sub.add_parser("compare", help="compare two metric files or run folders")
    compare.add_argument("a", help="side A: a metric file or run folder")
    compare.add_argument("b", help="side B: a metric file or run folder")
    _read_arguments(compare)
    compare.set_defaults(func=cmd_compare)

    report = sub.add_parser("report", help="write report.md and report.html for two runs")
    report.add_argument("a", help="side A: a metric file or run folder")
    report.add_argument("b", help="side B: a metric file or run folder")
    report.add_argument("-o", "--out", default="runs/report",
                        help="folder for report.md/report.html")  # fmt: skip
    _read_arguments(report)
    report.set_defaults(func=cmd_report)

    check = sub.add_parser(
        "check", help="run one spec on two git revisions (or against a golden file) and compare"
    )
    check.add_argument("--base", help="git revision of side A, e.g. origin/main")
    check.add_argument("--head", help="git revision of side B (default: HEAD)")
    check.add_argument("--golden", help="stored metrics file to compare the current tree with")
    _job_arguments(check)
    check.add_argument("--out", default="runs/check", help="run folders and report")
    check.add_argument("--allow-teardown-failure", action="store_true", help=_TEARDOWN_HELP)
    check.add_argument(
        "--no-trace",
        dest="trace",
        action="store_false",
        help="do not rerun revisions that diverged on the same batches up to their first "
        "divergent step with every op traced (the first differing op; on by default)",
    )
    _store_arguments(check, "the base")
    _run_read_arguments(check)
    _carry_argument(check)
    check.set_defaults(func=cmd_check)

    bis = sub.add_parser(
        "bisect", help="git bisect driven by the harness: the first commit whose run diverges"
    )
    bis.add_argument("--good", required=True, help="revision whose run is the reference")
    bis.add_argument("--bad", required=True, help="a later revision whose run diverges")
    _job_arguments(bis)
    bis.add_argument("--out", default="runs/bisect", help="reference, tested runs, bisect.json")
    _store_arguments(bis, "the good revision and every commit")
    _run_read_arguments(bis)
    _carry_argument(bis)
    bis.set_defaults(func=cmd_bisect)

    onpolicy = sub.add_parser(
        "onpolicy",
        help="rollout-vs-trainer log-prob chain of a PPO job: trainer m vs n, trainer vs "
        "rollout prefill, rollout decode vs prefill; names the first link that breaks",
    )
    onpolicy.add_argument(
        "run",
        nargs="?",
        help="a run folder holding the chain (onpolicy/); else the job given "
        "by --spec or --task is run first (a job that writes the chain)",
    )
    onpolicy.add_argument("--out", default="runs/onpolicy", help="run folder of the job it runs")
    _job_arguments(onpolicy)
    onpolicy.add_argument(
        "--max-ulp", type=int, default=0, help="float32 ULPs a link may differ by (default 0)"
    )
    onpolicy.add_argument("--json", action="store_true", help="print one JSON object")
    onpolicy.set_defaults(func=cmd_onpolicy)

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
    spec.set_defaults(func=cmd_spec)

    mutants = sub.add_parser("mutants", help="list the mutants installed packages register")
    mutants.add_argument("--catalogue", default=None, metavar="MODULE",
                         help="one catalogue module (default: every registered one)")  # fmt: skip
    mutants.set_defaults(func=cmd_mutants)

    presets = sub.add_parser("tasks", help="list the task presets installed packages register")
    presets.set_defaults(func=cmd_tasks)

    ci = sub.add_parser(
        "ci",
        help="print a CI workflow (GitHub Actions) or bash script that runs `parity check` of "
        "HEAD against its merge base with the spec",
    )
    _ci_arguments(ci)
    ci.set_defaults(func=cmd_ci)

    for s in (pair, compare, report, check, bis):
        s.add_argument(
            "--policy", action="append", default=[], metavar="METRIC=POLICY",
            help="how a metric (or glob) is judged: exact, ulp:K, close:RTOL,ATOL, ignore, or "
            "pieces POLICY@STEPS (repeat it; wins over the spec's [policies])",
        )  # fmt: skip
        s.add_argument("--json", action="store_true", help="print one JSON object")
    for s in (pair, compare, report, check):
        s.add_argument(
            "--at-source-precision", action="store_true",
            help="judge a metric whose log is rounded (4 decimals) at that precision: 'aligned "
            "at 4 decimals'; without it an exact policy on a rounded log is 'imprecise' (exit 5)",
        )  # fmt: skip
    return p


def _ci_arguments(parser: argparse.ArgumentParser) -> None:
    """`parity ci`: the spec, the base, the format and the lines that install."""
    parser.add_argument(
        "--spec",
        type=Path,
        required=True,
        help="the TOML/YAML job spec CI checks (checked now, as `parity spec` does)",
    )
    parser.add_argument(
        "--base",
        default=None,
        metavar="REF",
        help="the branch whose merge base with HEAD is side A, e.g. origin/main (default: "
        "github: the pull request's target branch; script: origin/main)",
    )
    parser.add_argument(
        "--format",
        choices=("github", "script"),
        default="github",
        help="github: a GitHub Actions workflow (default); script: bash for any CI",
    )
    parser.add_argument(
        "--install",
        default=None,
        metavar="CMD",
        help="the line that installs the harness (default: pip install llm-parity; '' leaves "
        "it out)",
    )
    parser.add_argument(
        "--project-install",
        default=None,
        metavar="CMD",
        help="your project's own install line, to edit (default: pip install -e .)",
    )
    parser.add_argument(
        "--python",
        default=None,
        metavar="VERSION",
        help="github: setup-python's python-version (default 3.11)",
    )


def _job_arguments(parser: argparse.ArgumentParser) -> None:
    """The job to run: a spec file, or a preset with keys, and the flags every job has."""
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
    _launcher_argument(parser)


def _launcher_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--launcher", choices=LAUNCHER_KINDS, default=None,
        help="where the torchruns run: local (this machine, default) or slurm (sbatch from "
        "here; the spec's [launcher] table sets nodes, partition, time, sbatch_args)",
    )  # fmt: skip


def _carry_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--carry", action="append", default=[], metavar="PATH",
        help="a path git ignores (a dataset), copied read-only from this checkout into each "
        "revision's worktree (repeatable; beside the spec's [check] carry)",
    )  # fmt: skip


def _run_read_arguments(parser: argparse.ArgumentParser) -> None:
    """How check and bisect read each side's run folder (default: the spec's [read] table)."""
    parser.add_argument("--format", choices=FORMATS, help="default: detected per side")
    parser.add_argument("--run", help="the run to read in a folder holding several")
    parser.add_argument(
        "--duplicates",
        choices=DUPLICATE_RULES,
        help="a step logged twice with other values: error (default), first or last",
    )
    parser.add_argument(
        "--allow-skipped",
        action="store_true",
        help="compare although a reader skipped records it could not use",
    )


def _read_arguments(parser: argparse.ArgumentParser) -> None:
    """How compare and report read their two sides."""
    parser.add_argument("--format", choices=FORMATS, help="default: detected per side")
    parser.add_argument(
        "--run", help="the run to read in a folder holding several (TensorBoard, W&B, MLflow)"
    )
    parser.add_argument("--run-a", help="--run for side A only")
    parser.add_argument("--run-b", help="--run for side B only")
    parser.add_argument(
        "--duplicates",
        choices=DUPLICATE_RULES,
        default="error",
        help="a step logged twice with other values (a restarted run): error (default), or keep "
        "the first or the last and say so",
    )
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
    parser.add_argument(
        "--allow-skipped",
        action="store_true",
        help="compare although a reader skipped records it could not use (the table says so)",
    )


def main(argv: list[str] | None = None) -> int:
    """The command line. SIGINT, SIGTERM and SIGHUP stop it alike (parity.run.signals): launches
    stopped, worktrees and temp folders removed, what was written kept, one line on stderr, exit
    130, 143 or 129. Output into a closed pipe (`parity compare A B | head`) ends quietly, 141."""
    from parity.run.signals import Interrupted, cancellable, quiet_closed_pipe

    args = build_parser().parse_args(argv)
    with cancellable() as owner:
        try:
            return _run(args)
        except Interrupted as e:
            if not owner:  # an outer handler (the pytest plugin's) reports it
                raise
            try:
                print(_interrupted_line(args, e.signame, e.exit_code), file=sys.stderr, flush=True)
            except BrokenPipeError:
                quiet_closed_pipe()
            return e.exit_code
        except BrokenPipeError:
            return quiet_closed_pipe()


_CLEANED_UP = {
    "pair": "launches stopped",
    "onpolicy": "launch stopped",
    "check": "launches stopped, temporary worktrees removed",
    "bisect": "launches stopped, temporary worktree and its bisect state removed",
}


def _interrupted_line(args: argparse.Namespace, signame: str, exit_code: int) -> str:
    """The one line an interrupted command prints: what, by which signal, where its results are."""
    line = f"parity: {args.command} interrupted by {signame} (exit {exit_code})"
    if args.command in _CLEANED_UP:
        line += f": {_CLEANED_UP[args.command]}"
    out = getattr(args, "out", None)
    return line + (f"; what was completely written is in {out}" if out else "")


def _run(args: argparse.Namespace) -> int:
    """The command, with every exception it may raise turned into the exit-code contract: bad
    input 2 (one line), a failed run 3, anything else a bug of ours, 70 with its traceback. An
    uncaught exception would leave as Python's exit 1, which a CI script reads as "diverged"."""
    try:
        code = args.func(args)
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's exit
        return code
    except InputError as e:  # the one class of bad input (parity.errors)
        return _bad_input(str(e))
    except LaunchError as e:
        refused = e.result.refused_arguments
        if refused is not None:  # e.g. a misspelled key in the spec's overrides
            source = getattr(args, "spec", None) or "the job's flags"
            return _bad_input(
                f"{source}: the job refused its arguments: {refused} (log: {e.result.run_dir})"
            )
        if getattr(args, "json", False):  # a crashed run is "failed", never aligned or diverged
            print(json.dumps({"verdict": "failed", **e.result.to_dict(), "error": str(e)}))
        print(f"parity: run failed: {e}", file=sys.stderr)
        return EXIT_RUN_FAILED
    except BrokenPipeError:
        raise  # main's closed pipe (141), not a path of the user's
    except OSError as e:
        if e.filename is not None or isinstance(e, _PATH_ERRORS):
            return _bad_input(_path_error(e))
        return _internal_error(e)
    except Exception as e:  # RecursionError included: a reader turns its own into MetricsError
        return _internal_error(e)


MAX_ERROR_LINE = 300  # characters of an error line; a longer one loses values, then its middle
# OSErrors about a path the user gave (--out a regular file, an unreadable input): bad input
_PATH_ERRORS = (
    FileExistsError, FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError,
)  # fmt: skip


def _error_line(text: str) -> str:
    """``text`` as one line of at most MAX_ERROR_LINE characters: the one place error lines are
    clipped, so that a 10 MB value quoted in a message cannot flood a CI log."""
    line = clip_message(re.sub(r"\s*\n\s*", " ", text.strip()))  # quoted values elided first
    if len(line) > MAX_ERROR_LINE:  # then the middle: the path in front, the advice at the end
        tail = MAX_ERROR_LINE // 3
        line = line[: MAX_ERROR_LINE - tail - 5] + " ... " + line[-tail:]
    return line


def _bad_input(message: str) -> int:
    print(_error_line(f"parity: error: {message}"), file=sys.stderr)
    return EXIT_BAD_INPUT


def _path_error(e: OSError) -> str:
    """'PATH: File exists' (both paths of a rename or link): the path first, as errors do here."""
    where = " -> ".join(str(f) for f in (e.filename, e.filename2) if f is not None)
    what = e.strerror or str(e) or type(e).__name__
    return f"{where}: {what}" if where else what


def _internal_error(e: Exception) -> int:
    """Not a verdict and not the user's input: a bug to report, with the traceback to report."""
    sys.stdout.flush()
    head = _error_line(f"parity: internal error, please report: {type(e).__name__}: {e}")
    print(head, file=sys.stderr)
    traceback.print_exception(type(e), e, e.__traceback__, file=sys.stderr)
    return EXIT_INTERNAL


if __name__ == "__main__":
    sys.exit(main())
