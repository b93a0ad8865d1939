"""A foreign training loop (plain torch, nothing of worker/) that writes its run with the
recorder: a tiny next-token model on random token ids, DDP over gloo under torchrun (or one
process without it). tests/record/test_recorder.py runs it.

--plant data: from step 3, rank 1 trains on other rows (a data-order bug);
--plant numeric: from step 3, fc2.weight's gradient gets an L2 term (a numeric bug in one layer);
--plant crash: the loop raises at step 3 (no end record).
--trace-step K: step K runs inside parity.record.trace_ops (every op, from its forward to its
optimizer step, into ops/rank{r}.jsonl).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import OrderedDict
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from parity.record import record_run, trace_ops

PLANT_STEP = 3


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--fingerprint-steps", default="")
    p.add_argument("--plant", choices=("none", "data", "numeric", "crash"), default="none")
    p.add_argument("--trace-step", type=int, default=0)
    args = p.parse_args()
    distributed = "RANK" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    layers = [("embed", torch.nn.Embedding(32, 16)), ("fc1", torch.nn.Linear(16, 16))]
    layers += [("act", torch.nn.Tanh()), ("fc2", torch.nn.Linear(16, 32))]
    model = torch.nn.Sequential(OrderedDict(layers))
    ddp = DistributedDataParallel(model) if distributed else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.randint(0, 32, (64, 9), generator=torch.Generator().manual_seed(1))

    # --- the loop: ~15 lines with the recorder ---------------------------------------------------
    with record_run(args.out, config=vars(args), fingerprint_steps=args.fingerprint_steps) as rec:
        for step in range(1, args.steps + 1):
            first = ((step - 1) * world + rank) * 2 % 62
            if args.plant == "data" and step >= PLANT_STEP and rank == 1:
                first += 1  # rank 1 reads one row off
            rows = data[first : first + 2]
            ids, labels = rows[:, :-1], rows[:, 1:]
            rec.batch(ids, labels)  # what this rank trains on
            traced = trace_ops(args.out, step, model) if step == args.trace_step else nullcontext()
            with traced:  # every op of the step, at --trace-step only
                loss = F.cross_entropy(ddp(ids).flatten(0, 1), labels.flatten())
                loss.backward()
                if args.plant == "numeric" and step >= PLANT_STEP:
                    model.fc2.weight.grad += 1e-3 * model.fc2.weight.detach()
                if args.plant == "crash" and step == PLANT_STEP:
                    raise RuntimeError(f"planted crash at step {step}")
                rec.fingerprint(step, model)  # pre-clip gradients, at the chosen steps
                grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
            opt.zero_grad()
            loss = loss.detach()
            if distributed:
                dist.all_reduce(loss)
                loss /= world
            rec.log(step, {"train/loss": loss, "train/grad_norm": grad_norm, "train/lr": 1e-2})
    if distributed:
        dist.barrier()
        dist.destroy_process_group()
    # everything is written: end here, before this function's locals are freed. Freeing `ddp`
    # frees the gloo group its reducer holds, and under torch 2.4.1 that destructor joins a gloo
    # thread waiting for the GIL it holds (seen in CI: rank 1 hung for good in
    # ~ProcessGroupGloo, called from ~Reducer); elsewhere gloo's threads can abort the teardown
    # ("terminate called without an active exception", SIGABRT, about one 2-rank run in three).
    # worker/entry.py skips the teardown the same way.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
