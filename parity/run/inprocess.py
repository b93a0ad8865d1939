"""Both sides of a pair in one torchrun launch: the start-up shared, the same bits by construction.

The harness side: whether two jobs can share a launch (`refusal`), the launch's command
(`command`: `-m parity.rank.warm ... -m MODULE ARGS --then -m MODULE ARGS`), and the launch
itself with its two run folders read back (`run_pair_in_process`). Each rank of it is a warm
process (parity.rank.warm, which runs in the user's ranks): numpy, torch and the jobs' `preload`
imported once, then a fresh child forked per side, one after the other, which runs that side as
`python -m MODULE ARGS` would; a side that fails ends the launch (which side: `_failed_side`),
and each side's children record the world they joined in world/side-K, judged side by side. A
module of the preload that fails to import is raised as a SpecError with the rank's line
(`raise_preload_error`), never skipped. Warm pools (parity.run.pool) use `refusal`,
`preload_args` and `alone_line` too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from parity.rank.warm import PRELOAD_ERROR, SEPARATOR
from parity.record.runfolder import metrics_path

if TYPE_CHECKING:
    from parity.run.job import Run
    from parity.run.launch import LaunchResult
    from parity.spec import JobSpec, PairSpec

FOLDER = "in-process"  # the launch's own folder in a pair folder: launcher.log, logs/, timing


def refusal(spec_a: JobSpec, spec_b: JobSpec) -> str | None:
    """Why these two jobs cannot share one launch (one line), or None when they can."""
    for name in ("world_size", "nnodes", "torchrun_args", "preload", "env"):
        va, vb = getattr(spec_a, name), getattr(spec_b, name)
        if va != vb:
            return f"in-process mode needs the same {name} on both sides ({va!r} vs {vb!r})"
    if spec_a.nnodes > 1:
        return f"in-process mode runs on one node, not {spec_a.nnodes}"
    for label, spec in (("a", spec_a), ("b", spec_b)):
        if not spec.distributed:
            return f"in-process mode runs distributed jobs; side {label} is distributed = false"
        args = dataclasses.replace(spec, inject=[]).to_args(Path("{out}"))
        if len(args) < 2 or args[0] != "-m":
            return f"in-process mode runs job modules (-m MODULE); side {label} runs a script"
    return None


def command(specs: Sequence[JobSpec], outs: Sequence[Path], timing: Path) -> list[str]:
    """Module args for torchrun that run every spec, in order, in one launch (a side with
    mutants keeps its parity.rank.mutants wrapper: they are applied to that side only); the
    specs' one preload list imported first (SpecError if they differ: see `refusal`)."""
    from parity.spec import SpecError

    preloads = {tuple(spec.preload) for spec in specs}
    if len(preloads) > 1:
        raise SpecError(f"in-process mode needs one preload for every side, not {preloads}")
    args = ["-m", "parity.rank.warm", "--timing", str(timing)]
    args += preload_args(specs[0].preload) if specs else []
    for i, (spec, out) in enumerate(zip(specs, outs, strict=True)):
        args += ([SEPARATOR] if i else []) + spec.to_args(out)
    return args


def run_pair_in_process(
    pair: PairSpec, out: Path, *, allow_teardown_failure: bool = False
) -> tuple[Run, Run]:
    """Run both sides in one launch; raise SpecError (refusal) or LaunchError (it failed).

    Writes the same a/ and b/ run folders as two launches, plus a launcher.log in each one's
    launch folder (a.launch/) whose first line is the separate launch that reproduces that side
    alone. A launch that fails only
    at teardown (both sides' metrics complete) is returned with allow_teardown_failure, as
    run_job does.
    """
    from parity.files import launch_dir
    from parity.outdir import OutDir
    from parity.run.job import Progress, Run, mark_teardown, read_output
    from parity.run.launch import LaunchError, LaunchRequest, launch
    from parity.spec import SpecError

    spec_a, spec_b = pair.sides()
    reason = refusal(spec_a, spec_b)
    if reason:
        raise SpecError(reason)
    out = Path(out).resolve()
    dirs = [out / "a", out / "b"]
    with OutDir.open(out) as held:
        for d in dirs:
            held.make_dir(d.name)
            held.make_dir(launch_dir(d).name)
        here = held.make_dir(FOLDER)
        timing = here / "timing.json"
        progress = Progress("B (after A, in-process)", spec_b.steps, metrics_path(dirs[1]))
        since = time.time()
        try:
            request = LaunchRequest(
                command([spec_a, spec_b], dirs, timing),
                nproc=spec_a.nproc_per_node,
                run_dir=here,
                timeout_s=spec_a.timeout_s + spec_b.timeout_s,
                env=spec_a.env,  # both sides' (refusal): the launch's, as each side's own
                torchrun_args=spec_a.torchrun_args,
                on_tick=progress.tick,
            )
            result = launch(request)
        except BaseException:
            progress.close(interrupted=True)
            raise
        progress.close()
    raise_preload_error(here)
    _judge_sides(result, spec_a.world_size)
    frames = [None, None]
    if not result.ok:
        frames = [mark_teardown(result, metrics_path(d), since) for d in dirs]
        if not allow_teardown_failure or any(f is None for f in frames):
            raise LaunchError(result, f"in-process pair, {_failed_side(timing)}")
    split = _split_seconds(timing, result.duration_s)
    runs = []
    for spec, d, seconds, frame in zip((spec_a, spec_b), dirs, split, frames, strict=True):
        note = f"# ran in-process with the other side in one launch: {here / 'launcher.log'}\n"
        _write_text(launch_dir(d) / "launcher.log", f"{alone_line(spec, d)}\n{note}")
        side = dataclasses.replace(result, duration_s=seconds)
        metrics = frame if frame is not None else read_output(side, d, f"side {d.name}")
        runs.append(Run(spec, d, side, metrics, in_process=True))
    return runs[0], runs[1]


def alone_line(spec: JobSpec, out: Path) -> str:
    """`# [VAR=value ...] torchrun ...`: the launch that reproduces this job on its own (a
    launcher.log's head), with the spec's env."""
    from parity.run.launch import reproduce_line

    alone = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    alone += ["--nproc-per-node", str(spec.nproc_per_node), *spec.to_args(out)]
    return f"# {reproduce_line(alone, spec.env)}"


def preload_args(modules: Sequence[str]) -> list[str]:
    """The warm process's flag for a spec's preload list ([] for none)."""
    return ["--preload", ",".join(modules)] if modules else []


def raise_preload_error(folder: Path) -> None:
    """SpecError with a rank's line if a module of the preload failed to import there."""
    from parity.spec import SpecError

    try:
        line = (folder / PRELOAD_ERROR).read_text(encoding="utf-8", errors="replace").strip()
    except FileNotFoundError:
        return
    raise SpecError(line or f"a module of the preload failed to import ({folder})")


def _judge_sides(result: LaunchResult, world_size: int) -> None:
    """Fail the launch for the first side whose children did not form the world asked for
    (each side's children record theirs under world/side-K; the warm ranks join none)."""
    from parity.run import world

    for k, label in enumerate("AB"):
        line = world.judge(result.world_dir / f"side-{k}", world_size)
        if line and result.returncode == 0:
            result.set_fault("world", f"side {label}: {line}")


def _failed_side(timing: Path) -> str:
    """Which side failed: the first that some rank saw fail, or else never saw end (each rank's
    warm process writes the sides it ended: timing.rank<R>.json beside timing.json)."""
    ended = []
    for path in sorted(timing.parent.glob(f"{timing.stem}.rank*.json")):
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            ended.append([int(side["exitcode"]) for side in json.loads(path.read_text())["sides"]])
    if not ended:
        return "before either side ended"
    failed = [codes.index(next(c for c in codes if c)) for codes in ended if any(codes)]
    k = min(failed) if failed else min(len(codes) for codes in ended)
    return "side A" if k == 0 else "side B (after A)" if k == 1 else "after both sides"


def _split_seconds(timing: Path, total: float) -> tuple[float, float]:
    """The launch's wall time as (A with the start-up, B): what each side added to it."""
    try:
        sides = json.loads(timing.read_text())["sides"]
        b = float(sides[1]["seconds"])
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        return total / 2, total / 2
    return max(total - b, 0.0), b


def _write_text(path: Path, text: str) -> None:
    from parity.files import write_text_atomic

    write_text_atomic(path, text)
