"""Tiny torchrun job for the launcher tests: succeeds or fails on purpose, chosen by env vars.

DUMMY_MODE: ok | raise | sigkill | hang | exit3; DUMMY_RANK: the rank that misbehaves (default 1);
DUMMY_OUT: folder where rank 0 writes metrics.jsonl in "ok" mode.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist


def main() -> None:
    mode = os.environ.get("DUMMY_MODE", "ok")
    bad_rank = int(os.environ.get("DUMMY_RANK", "1"))
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

    if mode == "ok":
        steps = 3
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t)
        if rank == 0:
            out = Path(os.environ["DUMMY_OUT"])
            out.mkdir(parents=True, exist_ok=True)
            with open(out / "metrics.jsonl", "w") as f:
                for i in range(steps):
                    f.write(json.dumps({"step": i, "train/loss": float(t.item()) / (i + 1)}) + "\n")
                f.write(json.dumps({"event": "end", "steps": steps}) + "\n")
    else:
        # the healthy ranks of a failing job wait here until torchrun tears them down
        dist.barrier()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
