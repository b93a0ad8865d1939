"""A plain job (``distributed = false``, ``world_size = 2``) whose 2 ranks are Ray actors, as
verl's RayWorkerGroup makes them: each actor's RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT come
from its ``runtime_env`` env_vars (set before its worker's interpreter starts), and it joins a
gloo group and all-reduces.

    python tests/jobs/ray_world.py --out DIR --python ENV_PYTHON [--broken]

This process (the harness's python) runs the Ray driver (``--driver``, with ``ENV_PYTHON``: an
environment with ray and torch, verl's) in a session of its own through
``subjects.verl.run_ppo.launch``, which ends whatever of that session is left afterwards (Ray's
daemons and workers), then writes metrics.jsonl (5 steps, the end record) into ``DIR`` once the
driver exited 0. ``--broken``: each actor is given a world of its own (WORLD_SIZE=1, RANK=0), so
they form two groups of one; the metrics are the same.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

# this folder (the script's): the plain job's 5 steps, and the rank variables of a world of 2
from plain_job import write_metrics
from plain_ranks import free_port, rank_variables

REPO = Path(__file__).resolve().parents[2]


def driver(broken: bool) -> None:
    """Start Ray, the 2 actors, their collectives; print the world each saw."""
    import ray

    ray.init(num_cpus=2, include_dashboard=False)

    @ray.remote(num_cpus=1)
    class Rank:
        def run(self) -> tuple[int, int]:
            import torch
            import torch.distributed as dist

            dist.init_process_group("gloo")
            t = torch.ones(1)
            dist.all_reduce(t)
            seen = (dist.get_rank(), dist.get_world_size())
            dist.destroy_process_group()
            return seen

    port = free_port()
    actors = [
        Rank.options(runtime_env={"env_vars": rank_variables(r, broken, port)}).remote()
        for r in range(2)
    ]
    print(json.dumps(ray.get([a.run.remote() for a in actors], timeout=120)), flush=True)
    ray.shutdown()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path)
    p.add_argument("--python", type=Path)
    p.add_argument("--broken", action="store_true")
    p.add_argument("--driver", action="store_true", help="(internal) be the Ray driver")
    args = p.parse_args()
    if args.driver:
        driver(args.broken)
        return 0
    sys.path.insert(0, str(REPO))
    from subjects.verl.run_ppo import launch

    args.out.mkdir(parents=True, exist_ok=True)
    command = [str(args.python), str(Path(__file__).resolve()), "--driver"]
    command += ["--broken"] if args.broken else []
    environ = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_DEDUP_LOGS": "0"}
    environ.pop("RAY_ADDRESS", None)  # a local cluster of its own
    with open(args.out / "driver.log", "wb") as log:
        rc, left = launch(command, args.out, environ, log, timeout_s=300)
    (args.out / "left.json").write_text(json.dumps(left))
    if rc:
        print(f"ray driver exited {rc}; see {args.out / 'driver.log'}", file=sys.stderr)
        return rc
    write_metrics(args.out, 1.0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
