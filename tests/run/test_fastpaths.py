"""The fast paths (an in-process pair, a warm pool) give the bits of plain launches, whatever the
jobs before did: each job runs in a fresh child of the warm rank process (parity.rank.warm).

A job that switches a shared library (a package of neither side's) to an "old kernel" through a
module global must not pass that switch on to the job after it, even where the warm ranks
imported that library for it (`preload`); and every task preset with every mutant, run one after
the other through each fast path (with the presets' own preload, worker.boot), matches its plain
launch bit for bit (the jobs and their runs: tests/run/catalogue.py; the same jobs through Slurm,
in one allocation and as parallel jobs: tests/run/test_slurm.py).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from parity import assert_parity
from parity.judge.compare import compare_frames
from parity.run.inprocess import run_pair_in_process
from parity.run.job import run_job
from parity.run.pool import Pools
from parity.spec import JobSpec, PairSpec, SpecError
from tests.run.catalogue import assert_bitwise

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


@pytest.mark.parity
def test_every_preset_and_mutant_runs_bitwise_through_each_fast_path(catalogue_runs):
    specs, plain = catalogue_runs.specs, catalogue_runs.plain
    assert {s.task for s in specs} >= {"charcount-sft", "charcount-ppo"}
    assert {tuple(s.preload) for s in specs} == {("worker.boot",)}  # the presets' preload
    for path, frames in catalogue_runs.fast.items():
        assert_bitwise(path, specs, frames, plain)
    for mutated, clean in zip(plain[0::2], plain[1::2], strict=True):  # each preset's mutants
        assert compare_frames(mutated, clean).failures  # did change its numbers
