"""The process group: joined from torchrun's (or accelerate's) environment, never home-made."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Dist:
    rank: int
    world: int
    local_rank: int
    device: torch.device
    backend: str


BACKEND_ENV = "PARITY_BACKEND"  # gloo or nccl instead of the device's default


def init_distributed() -> Dist:
    """Join the torchrun (or accelerate) process group: nccl on CUDA, gloo on CPU.

    Run without a launcher, it makes a one-process group, so the same code path serves tests.
    PARITY_FORCE_CPU=1 keeps a CUDA machine's job on the CPU; PARITY_BACKEND picks the backend
    (gloo on CUDA tensors: several ranks on one GPU, which NCCL refuses). Local rank r uses
    CUDA device r modulo the devices there are, so more ranks than GPUs share them (under gloo).
    """
    use_cuda = torch.cuda.is_available() and os.environ.get("PARITY_FORCE_CPU") != "1"
    backend = os.environ.get(BACKEND_ENV) or ("nccl" if use_cuda else "gloo")
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"{BACKEND_ENV}={backend!r}: expected nccl or gloo")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cpu")
    if use_cuda:
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        if "RANK" in os.environ:
            # device_id binds (and eagerly connects) an NCCL group; gloo takes none
            bound = device if backend == "nccl" else None
            dist.init_process_group(backend, device_id=bound)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return Dist(dist.get_rank(), dist.get_world_size(), local_rank, device, backend)


def shutdown_distributed() -> None:
    """Barrier before destroy: a bare destroy aborts ~12% of multi-rank runs on CPU at exit."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def all_reduce_sum(value: float | torch.Tensor, device: torch.device) -> torch.Tensor:
    t = torch.as_tensor(value, dtype=torch.float64 if not torch.is_tensor(value) else None)
    t = t.detach().clone().to(device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def all_reduce_max(value: int, device: torch.device) -> int:
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())
