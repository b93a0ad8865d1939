"""A plain accelerate loop that logs through `accelerator.log` to parity.record.accelerate's
ParityTracker, as a script using accelerate's trackers would.

    ACCELERATE_USE_CPU=true torchrun --nproc-per-node 2 tests/jobs/accelerate_tracker.py --out DIR

(ACCELERATE_USE_CPU: see accelerate_loop.py.) `--lr` on one side is the planted change
tests/record/test_loggers.py runs.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F
from accelerate import Accelerator

from parity.record.accelerate import ParityTracker


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False)
    p.add_argument("--out", required=True)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--steps", type=int, default=4)
    args = p.parse_args()
    accelerator = Accelerator(log_with=[ParityTracker(args.out)])
    accelerator.init_trackers("tiny", config=vars(args))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(32, 16), torch.nn.Linear(16, 32))
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    data = torch.randint(0, 32, (64, 9), generator=torch.Generator().manual_seed(1))
    model, opt = accelerator.prepare(model, opt)
    rank, world = accelerator.process_index, accelerator.num_processes
    for step in range(1, args.steps + 1):
        first = ((step - 1) * world + rank) * 2 % 62
        ids, labels = data[first : first + 2, :-1], data[first : first + 2, 1:]
        if accelerator.is_main_process:  # the tracker lives on the main process only
            accelerator.get_tracker("parity", unwrap=True).batch(ids, labels)
        loss = F.cross_entropy(model(ids).flatten(0, 1), labels.flatten())
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
        mean = accelerator.reduce(loss.detach(), reduction="mean")
        accelerator.log({"train/loss": mean, "train/lr": args.lr}, step=step)
    accelerator.end_training()  # the end record; destroys the process group


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip gloo's interpreter teardown, which can abort (see foreign_loop.py)
