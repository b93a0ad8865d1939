"""The fast paths (an in-process pair, a warm pool) give the bits of plain launches, whatever the
jobs before did: each job runs in a fresh child of the warm rank process (parity.run.inprocess).

A job that switches a shared library (a package of neither side's) to an "old kernel" through a
module global must not pass that switch on to the job after it, even where the warm ranks
imported that library for it (`preload`); and every task preset with every mutant, run one after
the other through each fast path (with the presets' own preload, worker.boot), matches its plain
launch bit for bit.
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from parity import assert_parity
from parity.judge.compare import compare_frames
from parity.readers import read_metrics
from parity.run import world
from parity.run.inprocess import command, run_pair_in_process
from parity.run.job import run_job
from parity.run.launch import launch
from parity.run.pool import Pools
from parity.spec import JobSpec, PairSpec, SpecError
from parity.tasks import catalogues, load_catalogue, registered

ROOT = Path(__file__).resolve().parents[2]

KERNELS = '''
"""A library both sides import: its kernel is chosen by a module global."""
KERNEL = "new"


def use_old_kernel():
    global KERNEL
    KERNEL = "old"


def square(x):
    return x * x if KERNEL == "new" else x * x * (1 + 2.0**-40)
'''

JOB = '''
"""A 2-rank job whose legacy side switches the shared library to its old kernel."""
import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import sharedkernels


def train(argv):
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--legacy", action="store_true")
    args = p.parse_args(argv)
    if args.legacy:
        sharedkernels.use_old_kernel()
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    records = []
    for step in range(1, 4):
        loss = sharedkernels.square(torch.tensor([rank + step / 3], dtype=torch.float64))
        dist.all_reduce(loss)
        records.append({"step": step, "train/loss": loss.item()})
    if rank == 0:
        lines = [json.dumps(r) for r in records] + [json.dumps({"event": "end", "steps": 3})]
        Path(args.out, "metrics.jsonl").write_text("\\n".join(lines) + "\\n")
    dist.barrier()


if __name__ == "__main__":
    train(sys.argv[1:])
    dist.destroy_process_group()
'''


@pytest.fixture
def shared_state_pair(tmp_path, monkeypatch) -> PairSpec:
    """Legacy (A, switches the shared library to its old kernel) vs new (B): they differ."""
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "sharedkernels.py").write_text(KERNELS)
    (lib / "statejob.py").write_text(JOB)
    monkeypatch.setenv("PYTHONPATH", f"{lib}:{ROOT}")
    base = JobSpec(task="custom", command=["-m", "statejob", "--out", "{out}"], world_size=2)
    legacy = ["-m", "statejob", "--out", "{out}", "--legacy"]
    return PairSpec(base, {"command": legacy}, {})


@pytest.mark.parity
def test_a_shared_librarys_state_never_reaches_the_next_job(shared_state_pair, tmp_path):
    """Two launches say diverged; so do the in-process pair (the library preloaded by its warm
    ranks) and a warm pool, with their bits. A pool of another preload list is another pool; a
    preload that fails to import is an error naming it, in either path."""
    spec_a, spec_b = shared_state_pair.sides()
    alone = [run_job(spec_a, tmp_path / "alone-a"), run_job(spec_b, tmp_path / "alone-b")]
    assert compare_frames(alone[0].metrics, alone[1].metrics).failures  # the pair diverges
    preloaded = dataclasses.replace(
        shared_state_pair, base=shared_state_pair.base.replace(preload=["sharedkernels"])
    )
    together = run_pair_in_process(preloaded, tmp_path / "in-process")
    bad = spec_b.replace(preload=["sharedkernels", "no_such_kernels"])
    pools = Pools(tmp_path / "pools")
    try:
        pooled = [pools.run(spec_a, tmp_path / "pool-a"), pools.run(spec_b, tmp_path / "pool-b")]
        with pytest.raises(SpecError, match="preload: cannot import 'no_such_kernels'"):
            pools.run(bad, tmp_path / "pool-bad")
    finally:
        pools.close()
    for fast in (together, pooled):
        for run, launched in zip(fast, alone, strict=True):
            assert run is not None and run.in_process
            assert_parity(run, launched)  # bitwise the side's own launch
    assert sorted(p.name for p in (tmp_path / "pools").iterdir()) == ["pool00-w2", "pool01-w2"]
    with pytest.raises(SpecError, match="preload: cannot import 'no_such_kernels'"):
        run_pair_in_process(PairSpec(bad), tmp_path / "in-process-bad")


# --- every preset and every mutant: each fast path against plain launches ------------------------

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


def _preset(task: str, inject: list[str] | None = None) -> JobSpec:
    return JobSpec(task=task, world_size=2, steps=2, inject=inject or [], **SMALL.get(task, {}))


def _catalogue() -> list[JobSpec]:
    """Each registered preset with every deterministic mutant of every catalogue applied at once
    (each patches its own function), then clean: the clean job comes after the mutated one, so
    a mutant that outlived its job would show there. Last, the job that fails on purpose."""
    mutants = {name for module in catalogues().values() for name in load_catalogue(module)}
    inject = sorted(mutants - NONDETERMINISTIC - {FAILING[1]})
    jobs = [job for task in sorted(registered()) for job in (_preset(task, inject), _preset(task))]
    return [*jobs, _preset(FAILING[0], [FAILING[1]])]


def _in_process(specs: list[JobSpec], folder: Path) -> list:
    """Every job as a side of one in-process launch, in order (the last fails, which fails the
    launch); each side's metrics, None for the last."""
    outs = [folder / f"side-{k}" for k in range(len(specs))]
    for out in outs:
        out.mkdir(parents=True)
    result = launch(command(specs, outs, folder / "timing.json"), nproc=2, run_dir=folder / "run")
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


@pytest.mark.parity
def test_every_preset_and_mutant_runs_bitwise_through_each_fast_path(tmp_path):
    specs = _catalogue()
    assert {s.task for s in specs} >= {"charcount-sft", "charcount-ppo"}
    assert {tuple(s.preload) for s in specs} == {("worker.boot",)}  # the presets' preload
    # the fast paths run beside the plain launches: each launch leaves a core idle at times
    with ThreadPoolExecutor(2) as fast_paths:
        running = {"in-process": fast_paths.submit(_in_process, specs, tmp_path / "in-process"),
                   "pool": fast_paths.submit(_pooled, specs, tmp_path / "pool")}  # fmt: skip
        plain = [
            run_job(spec, tmp_path / f"plain-{k}").metrics for k, spec in enumerate(specs[:-1])
        ]
        fast = {path: future.result() for path, future in running.items()}
    for path, frames in fast.items():
        for spec, got, want in zip(specs, frames, plain, strict=False):
            what = f"{path}: {spec.task} with {len(spec.inject)} mutants"
            assert got is not None, what
            comparison = compare_frames(got, want)  # exact, but for the timings (ignored)
            assert not comparison.failures and len(comparison.metrics) > 5, what
    for mutated, clean in zip(plain[0::2], plain[1::2], strict=True):  # each preset's mutants
        assert compare_frames(mutated, clean).failures  # did change its numbers
