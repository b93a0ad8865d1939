"""A job that is not distributed, for the plain launcher's tests: the standard library only (no
torch), so it runs where torch is not installed. Misbehaves on purpose, chosen by ``--mode``:

ok: writes metrics.jsonl (5 steps and the end record) into ``--out``, and the rank variables it
saw (env.json); raise | exit3 | sigkill: fails so; hang: sleeps, after a line on stdout;
hang-at-exit: writes complete metrics, then sleeps; orphan: starts a grandchild in a session of
its own (its pid in orphan.pid), then hangs.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

RANK_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def write_metrics(out: Path, factor: float) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "metrics.jsonl", "w") as f:
        for step in range(1, 6):
            loss = 1.0 / step * (factor if step >= 3 else 1.0)
            f.write(json.dumps({"step": step, "train/loss": loss}) + "\n")
        f.write(json.dumps({"event": "end", "steps": 5}) + "\n")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", default="ok")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--factor", type=float, default=1.0)
    args = p.parse_args()
    print(f"plain job up, mode={args.mode}", flush=True)
    if args.mode == "raise":
        raise RuntimeError("boom from the plain job")
    if args.mode == "exit3":
        sys.exit(3)
    if args.mode == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    if args.mode == "orphan":
        args.out.mkdir(parents=True, exist_ok=True)
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                                 start_new_session=True)  # fmt: skip
        (args.out / "orphan.pid").write_text(str(child.pid))
    if args.mode in ("hang", "orphan"):
        time.sleep(600)
    write_metrics(args.out, args.factor)
    (args.out / "env.json").write_text(json.dumps({k: os.environ.get(k) for k in RANK_VARIABLES}))
    if args.mode == "hang-at-exit":
        time.sleep(600)


if __name__ == "__main__":
    main()
