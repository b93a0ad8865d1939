"""A plain job (``distributed = false``, ``world_size = 2``) that starts its own 2 ranks, as a
Ray worker group does: each a fresh interpreter given RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT before it starts (no LOCAL_RANK), which joins a gloo group and all-reduces. The job
writes metrics.jsonl (5 steps, the end record) into ``--out`` once both ranks exited 0.

``--broken``: each rank is given a world of its own (WORLD_SIZE=1, RANK=0), the mistake of a
launcher that forgot its ranks' variables; the ranks run alone, the metrics are the same.
``--replace-pythonpath``: the ranks get ``PYTHONPATH`` set to this folder alone, as a wrapper that
replaces it instead of adding to it would (the harness's start-up hook is then gone).
``--hang``: rank 1 sleeps instead of joining the all-reduce, so rank 0 waits in it for good.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
from pathlib import Path

from plain_job import write_metrics  # this folder: the plain job's 5 steps

RANK = """\
import os, time, torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1)
if os.environ.get("HANG") and dist.get_rank() == 1:
    time.sleep(3600)
dist.all_reduce(t)
assert t.item() == dist.get_world_size(), t
dist.destroy_process_group()
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rank_variables(rank: int, broken: bool, port: int) -> dict[str, str]:
    """What a launcher gives rank ``rank`` of a world of 2 before it starts (verl's
    RayWorkerGroup: in the actor's runtime_env), or with ``broken`` a world of one with a store
    of its own. tests/jobs/ray_world.py gives its actors the same."""
    if broken:
        ranks = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": str(free_port())}
    else:
        ranks = {"RANK": str(rank), "WORLD_SIZE": "2", "MASTER_PORT": str(port)}
    return {"MASTER_ADDR": "127.0.0.1", **ranks}


def rank_env(rank: int, args: argparse.Namespace, port: int) -> dict[str, str]:
    """The rank's variables, on top of this process's (what Ray does with runtime_env)."""
    env = {**os.environ, **rank_variables(rank, args.broken, port)}
    if args.replace_pythonpath:
        env["PYTHONPATH"] = str(Path(__file__).resolve().parent)
    if args.hang:
        env["HANG"] = "1"
    return env


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--broken", action="store_true")
    p.add_argument("--replace-pythonpath", action="store_true")
    p.add_argument("--hang", action="store_true")
    args = p.parse_args()
    port = free_port()
    ranks = [
        subprocess.Popen([sys.executable, "-c", RANK], env=rank_env(r, args, port))
        for r in range(2)
    ]
    codes = [proc.wait() for proc in ranks]
    if any(codes):
        sys.exit(f"ranks exited {codes}")
    write_metrics(args.out, 1.0)


if __name__ == "__main__":
    main()
