"""One DDP step, traced on every rank twice (under torchrun, gloo): into OUT/a with every rank's
own batch, and into OUT/b with rank DIFFER's batch drawn from another seed. The other ranks' own
ops are the same in both; only what the gradients' all-reduce returns them differs.

``gather``: instead, each rank's weight shard (FSDP's) is all-gathered and used, and in OUT/b
every rank's shard is drawn from another seed: each rank's own input to the collective differs.

Usage: torchrun --standalone --nproc-per-node 2 ddp_rank_data.py OUT DIFFER [gather]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from parity.record import trace_ops


def step(out: Path, rank: int, seed: int) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(seed))
    with trace_ops(out, 1, model, rank=rank):
        ddp(x).pow(2).mean().backward()
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
        opt.step()


def gathered(out: Path, rank: int, seed: int) -> None:
    shard = torch.randn(2, 4, generator=torch.Generator().manual_seed(seed))
    x = torch.ones(3, 4)
    with trace_ops(out, 1, rank=rank):
        parts = [torch.empty_like(shard) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, shard)
        (x @ torch.cat(parts).t()).sum()


def main() -> None:
    out, differ = Path(sys.argv[1]), int(sys.argv[2])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if sys.argv[3:] == ["gather"]:
        gathered(out / "a", rank, seed=rank)
        gathered(out / "b", rank, seed=rank + 100)
    else:
        step(out / "a", rank, seed=rank)
        step(out / "b", rank, seed=rank + (100 if rank == differ else 0))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
