"""Tiny torchrun job for the launcher tests: succeeds or fails on purpose, chosen by env vars.

DUMMY_MODE: ok | raise | sigkill | hang | exit3 | abort-at-exit | hang-at-exit | abort-early;
DUMMY_RANK: the rank that misbehaves (default 1); DUMMY_OUT: folder where rank 0 writes
metrics.jsonl in "ok" and the *-at-exit modes. ``--mode``, ``--rank`` and ``--out`` on the command
line override them (a JobSpec "custom" command has no environment of its own).

abort-at-exit / hang-at-exit: complete metrics (end record), a clean process-group shutdown, then
the bad rank aborts (SIGABRT, like "terminate called without an active exception") or hangs.
abort-early: rank 0 writes two steps without the end record, then the bad rank aborts.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", default=os.environ.get("DUMMY_MODE", "ok"))
    p.add_argument("--rank", type=int, default=int(os.environ.get("DUMMY_RANK", "1")))
    p.add_argument("--out", default=os.environ.get("DUMMY_OUT"))
    args, _ = p.parse_known_args()
    mode, bad_rank = args.mode, args.rank
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    print(f"rank {rank} up, mode={mode}", flush=True)
    is_bad = rank == bad_rank

    if mode == "raise" and is_bad:
        raise RuntimeError(f"boom from rank {rank}")
    if mode == "sigkill" and is_bad:
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "exit3" and is_bad:
        sys.exit(3)
    if mode == "hang":
        if is_bad:
            while True:
                time.sleep(1)
        t = torch.ones(1)
        dist.all_reduce(t)  # never completes: the bad rank never joins

    if mode in ("ok", "abort-at-exit", "hang-at-exit", "abort-early"):
        early = mode == "abort-early"
        steps = 2 if early else 3
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t)
        if rank == 0:
            out = Path(args.out)
            out.mkdir(parents=True, exist_ok=True)
            with open(out / "metrics.jsonl", "w") as f:
                for i in range(steps):
                    f.write(json.dumps({"step": i, "train/loss": float(t.item()) / (i + 1)}) + "\n")
                if not early:
                    f.write(json.dumps({"event": "end", "steps": steps}) + "\n")
        if early:
            dist.barrier()  # rank 0 has written its partial metrics
            if is_bad:
                os.abort()
            dist.barrier()  # never completes: torchrun tears this rank down
    else:
        # the healthy ranks of a failing job wait here until torchrun tears them down
        dist.barrier()
    dist.barrier()
    dist.destroy_process_group()
    if is_bad and mode == "abort-at-exit":
        time.sleep(0.5)  # rank 0 has exited cleanly by now, as in a real teardown crash
        os.abort()
    if is_bad and mode == "hang-at-exit":
        while True:
            time.sleep(1)


if __name__ == "__main__":
    main()
