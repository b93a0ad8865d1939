"""A job that writes a few steps with the recorder, then hangs on purpose (tests/run/test_stall.py).

--mode collective (under torchrun, 2 ranks): the recorder on rank 0 only, and at the last step a
metric all-reduced when the recorder reads it (inside rec.log): rank 0 waits in that all_reduce,
rank 1 has gone on to the barrier after the loop.
--mode sleep: after --steps steps the loop sleeps (a rank stuck outside any collective); one
plain process when not under torchrun.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

from parity.record import record_run


class Reduced:
    """A metric summed over the ranks when the recorder asks for its value."""

    def __init__(self, value: float):
        self.value = torch.tensor(value)

    def item(self) -> float:
        dist.all_reduce(self.value)  # rank 0 waits here: rank 1 never logs
        return self.value.item()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--mode", choices=("collective", "sleep"), default="collective")
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args()
    distributed = "RANK" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    with record_run(args.out, config=vars(args)) as rec:
        for step in range(1, args.steps + 1):
            loss = torch.tensor(1.0 / step)
            if distributed:
                dist.all_reduce(loss)
            metrics = {"train/loss": loss}
            if args.mode == "collective" and step == args.steps:
                metrics["train/tokens"] = Reduced(8.0)
            if rank == 0:  # the recorder on rank 0 only
                rec.log(step, metrics)
            time.sleep(0.2)
        if args.mode == "sleep":
            time.sleep(3600)  # stuck, outside any collective
        if distributed:
            dist.barrier()  # rank 1 waits here for rank 0, stuck in the all_reduce


if __name__ == "__main__":
    main()
