"""A plain accelerate training loop with the recorder, as a stranger's script would be.

    torchrun --nproc-per-node 2 tests/jobs/accelerate_loop.py --out DIR [--stretch-lr]

Accelerate forms the process group only when it knows it runs distributed: on a machine without
a GPU that takes ``ACCELERATE_USE_CPU=true``; without it each of the 2 processes trains alone on
the whole data as rank 0 of a world of one. ``--stretch-lr`` is a bug that only shows with more
than one process: the learning rate scaled by the number of processes.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F
from accelerate import Accelerator

from parity.record import record_run


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--stretch-lr", action="store_true")
    args = p.parse_args()
    if os.listdir(args.out):  # as HF's scripts refuse a non-empty output_dir
        sys.exit(f"output folder {args.out} is not empty: {sorted(os.listdir(args.out))}")
    accelerator = Accelerator()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(32, 16), torch.nn.Linear(16, 32))
    lr = 1e-2 * (accelerator.num_processes if args.stretch_lr else 1)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    data = torch.randint(0, 32, (64, 9), generator=torch.Generator().manual_seed(1))
    model, opt = accelerator.prepare(model, opt)
    rank, world = accelerator.process_index, accelerator.num_processes
    with record_run(args.out, config=vars(args)) as rec:
        for step in range(1, args.steps + 1):
            first = ((step - 1) * world + rank) * 2 % 62
            ids, labels = data[first : first + 2, :-1], data[first : first + 2, 1:]
            rec.batch(ids, labels)
            loss = F.cross_entropy(model(ids).flatten(0, 1), labels.flatten())
            accelerator.backward(loss)
            opt.step()
            opt.zero_grad()
            mean = accelerator.reduce(loss.detach(), reduction="mean")
            rec.log(step, {"train/loss": mean, "train/lr": lr})
    accelerator.wait_for_everyone()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip gloo's interpreter teardown, which can abort (see foreign_loop.py)
