"""Every task preset with every deterministic mutant, then clean: the jobs the differential test
runs through each fast path and each launcher, against plain launches of the same jobs.

The plain launches are made once per test session (``catalogue_runs`` in tests/run/conftest.py)
with the in-process path and a warm pool running beside them (each launch leaves a core idle at
times); the Slurm module compares its own launches with the same plain runs.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from parity.judge.compare import compare_frames
from parity.rank.mutants import catalogues
from parity.readers import read_metrics
from parity.run import world
from parity.run.inprocess import command
from parity.run.job import run_job
from parity.run.launch import LaunchRequest, launch
from parity.run.pool import Pools
from parity.spec import JobSpec
from parity.tasks import load_catalogue, registered

#: its data order comes from the clock: no two runs alike, however launched (the noise floor's)
NONDETERMINISTIC = {"sampler-seed-from-time"}
#: refuses to start (a reward model with no implementation): a failure, however launched
FAILING = ("charcount-ppo", "reward-missing-engine", "has no engine or legacy implementation")
#: each preset in 2 steps, at world 2; PPO's batch at its smallest: 2 prompts a rank, 2 updates
#: an epoch (its default 2 epochs)
SMALL = {
    "charcount-ppo": {"global_batch_size": 4, "micro_batch_size": 1,
                      "overrides": {"ppo_mini_batch_size": 2}},
}  # fmt: skip


def preset(task: str, inject: list[str] | None = None) -> JobSpec:
    return JobSpec(task=task, world_size=2, steps=2, inject=inject or [], **SMALL.get(task, {}))


def catalogue() -> list[JobSpec]:
    """Each registered preset with every deterministic mutant of every catalogue applied at once
    (each patches its own function), then clean: the clean job comes after the mutated one, so
    a mutant that outlived its job would show there. Last, the job that fails on purpose."""
    mutants = {name for module in catalogues().values() for name in load_catalogue(module)}
    inject = sorted(mutants - NONDETERMINISTIC - {FAILING[1]})
    jobs = [job for task in sorted(registered()) for job in (preset(task, inject), preset(task))]
    return [*jobs, preset(FAILING[0], [FAILING[1]])]


@dataclass
class CatalogueRuns:
    """The catalogue's jobs and their metrics per path: plain launches (all but the failing
    job), the in-process path and a warm pool (None for the failing job, as it must fail)."""

    specs: list[JobSpec]
    plain: list[pd.DataFrame]
    fast: dict[str, list[pd.DataFrame | None]]


def _in_process(specs: list[JobSpec], folder: Path) -> list:
    """Every job as a side of one in-process launch, in order (the last fails, which fails the
    launch); each side's metrics, None for the last."""
    outs = [folder / f"side-{k}" for k in range(len(specs))]
    for out in outs:
        out.mkdir(parents=True)
    request = LaunchRequest(command(specs, outs, folder / "timing.json"), 2, folder / "run")
    result = launch(request)
    assert not result.ok and FAILING[2] in result.describe()
    for k in range(len(specs) - 1):  # each side's children formed a world of 2 of their own
        assert world.judge(folder / "run" / "world" / f"side-{k}", 2) == ""
    return [read_metrics(out) for out in outs[:-1]] + [None]


def _pooled(specs: list[JobSpec], folder: Path) -> list:
    """Every job through one warm pool, in order; each one's metrics, None for the last (it
    failed in the pool: the caller would launch it alone)."""
    pools = Pools(folder / "pools")
    try:
        runs = [pools.run(spec, folder / f"job-{k}") for k, spec in enumerate(specs)]
    finally:
        pools.close()
    assert runs[-1] is None and all(run.in_process for run in runs[:-1])
    return [run.metrics for run in runs[:-1]] + [None]


def run_catalogue(folder: Path) -> CatalogueRuns:
    """The catalogue through plain launches, with the in-process path and a pool beside them."""
    specs = catalogue()
    with ThreadPoolExecutor(2) as fast_paths:
        running = {"in-process": fast_paths.submit(_in_process, specs, folder / "in-process"),
                   "pool": fast_paths.submit(_pooled, specs, folder / "pool")}  # fmt: skip
        plain = [run_job(spec, folder / f"plain-{k}").metrics for k, spec in enumerate(specs[:-1])]
        fast = {path: future.result() for path, future in running.items()}
    return CatalogueRuns(specs, plain, fast)


def read_catalogue(folder: Path) -> CatalogueRuns:
    """The runs ``run_catalogue`` made in ``folder``, read back from their run folders (what a
    second pytest-xdist worker takes instead of making them again)."""
    specs = catalogue()
    kept = range(len(specs) - 1)  # the last job failed on purpose, through every path

    def frames(name: str) -> list:
        return [read_metrics(folder / name.format(k=k)) for k in kept]

    fast = {"in-process": [*frames("in-process/side-{k}"), None],
            "pool": [*frames("pool/job-{k}"), None]}  # fmt: skip
    return CatalogueRuns(specs, frames("plain-{k}"), fast)


def assert_bitwise(path: str, specs: list, frames: list, plain: list) -> None:
    """Each job's metrics through ``path`` equal its plain launch's, but for the timings."""
    for spec, got, want in zip(specs, frames, plain, strict=False):
        what = f"{path}: {spec.task} with {len(spec.inject)} mutants"
        assert got is not None, what
        comparison = compare_frames(got, want)  # exact, but for the timings (ignored)
        assert not comparison.failures and len(comparison.metrics) > 5, what
