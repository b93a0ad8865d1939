"""How every job process starts and ends under torchrun (or accelerate launch).

One place for the lifecycle both entry points need: the start-up every job runs first
(worker.boot: offline Hugging Face settings and the heavy imports, what the presets' `preload`
names), torchrun's `record` (so a failing rank's own traceback reaches the launcher's summary),
the timing file the benchmarks read, and a clean teardown.
"""

from __future__ import annotations

import worker.boot  # noqa: F401  (first: before any code of the job's own; its docstring says why)

# isort: split
import argparse
import dataclasses
import gc
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn


def _lifecycle(train: Callable[[list[str] | None], None], argv: list[str] | None) -> int:
    from worker.distributed import shutdown_distributed

    train(argv)
    # Free the wrapped models while the process group still exists: destroyed after it, a DDP
    # or FSDP module's C++ destructor hung a gloo rank at exit in about 1 run in 8 here. Frozen
    # objects (resume_gc_for_training) are never collected: unfreeze first.
    gc.unfreeze()
    gc.collect()
    shutdown_distributed()  # barrier first, then destroy
    return 0


def pause_gc_until_training() -> None:
    """Turn the cyclic garbage collector off for a job's start-up: `run_job` does first, each
    job's `train` again before its own imports (for a caller of `train` without `run_job`), and
    worker.boot around the heavy imports. A job in a fast path (in-process, pooled) starts as a
    launched one does, a fresh process running `python -m MODULE` from the top, forked from a
    warm rank that imported only numpy, torch and its preset's preload (worker.boot).

    Why: importing torch, DTensor and transformers and building the job makes about 600,000
    objects that live as long as the process, and the collector walks them again and again
    while they pile up. Off until training starts, then frozen (`resume_gc_for_training`): a
    2-rank, 4-step launch took 11.8 instead of 13.6 CPU-s here (median of 10, interleaved), its
    largest process 8 MB more. No number changes: the collector frees memory, it computes
    nothing (launched, in-process and pooled jobs are bitwise equal: tests/run/test_inprocess.py,
    tests/run/test_pool.py).
    """
    gc.disable()


def resume_gc_for_training() -> None:
    """After a paused start-up: freeze what it made (never walked again), collector back on.

    Its few thousand garbage objects stay until the job ends; `_lifecycle` unfreezes everything
    before the collection that frees the models.
    """
    if not gc.isenabled():
        gc.freeze()
        gc.enable()


def run_job(train: Callable[[list[str] | None], None], argv: list[str] | None = None) -> NoReturn:
    """Run `train(argv)` as a torchrun rank, then exit without interpreter teardown."""
    pause_gc_until_training()
    from torch.distributed.elastic.multiprocessing.errors import record

    code = record(_lifecycle)(train, argv)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)  # everything the job wrote is closed; skip the remaining destructors


def fit_and_finish(
    job, fit: Callable[[], None], after_fit: Callable[[], None] | None = None
) -> None:
    """Train, write timing.json (rank 0), then the end record that marks the run complete."""
    from worker.metrics_log import write_json_atomic

    resume_gc_for_training()
    try:
        start = time.perf_counter()
        fit()
        if job.dist.rank == 0:  # what a benchmark compares the harness's wall time against
            seconds = time.perf_counter() - start
            write_json_atomic(job.cfg.out / "timing.json", {"train_seconds": seconds})
        if after_fit is not None:
            after_fit()
        job.log.finish(getattr(job.cfg, "last_step", job.cfg.steps))  # --stop-after K: K
    finally:
        job.log.close()


def job_arg_parser(
    prog: str, description: str, config_cls: type, trainers: tuple[str, ...] = ("legacy", "worker")
) -> argparse.ArgumentParser:
    """The flags every job shares (what parity.spec.JobSpec.to_args emits); defaults come from
    the job's config dataclass, so each job keeps its own, and so do its trainers."""
    from worker.losses import AGG_MODES

    d = {f.name: f.default for f in dataclasses.fields(config_cls)}
    # no abbreviations: a misspelled or shortened flag is refused, never taken for another one
    p = argparse.ArgumentParser(prog=prog, description=description, allow_abbrev=False)
    p.add_argument("--out", type=Path, required=True, help="run folder for metrics and manifest")
    p.add_argument("--trainer", choices=list(trainers), default=d["trainer"])
    p.add_argument("--engine", choices=["fsdp2", "ddp"], default=d["engine"])
    for flag, kind in (("steps", int), ("seed", int), ("global_batch_size", int)):
        p.add_argument("--" + flag.replace("_", "-"), type=kind, default=d[flag])
    p.add_argument("--micro-batch-size", type=int, default=d["micro_batch_size"])
    p.add_argument("--dynamic-bsz", action="store_true")
    p.add_argument("--max-tokens-per-rank", type=int, default=d["max_tokens_per_rank"])
    p.add_argument("--padded", action="store_true", help="padded batches instead of packed")
    for flag in ("lr", "warmup_ratio", "min_lr_ratio", "clip_grad"):
        p.add_argument("--" + flag.replace("_", "-"), type=float, default=d[flag])
    p.add_argument("--loss-agg-mode", choices=AGG_MODES, default=d["loss_agg_mode"])
    p.add_argument("--val-loss", choices=["fixed", "legacy"], default=d["val_loss"])
    p.add_argument("--model", type=Path, default=d["model"], help="any local HF model folder")
    p.add_argument("--tokenizer", type=Path, default=None, help="default: the model's, else ours")
    p.add_argument("--data", type=Path, default=d["data"])
    p.add_argument("--attn", default=d["attn"])
    p.add_argument(
        "--trace-step",
        type=int,
        default=0,
        metavar="K",
        help="hash every op's output of step K (forward, backward, clip, optimizer; PPO: the "
        "actor's first update) into ops/",
    )
    p.add_argument(
        "--stop-after",
        type=int,
        default=0,
        metavar="K",
        help="end after step K, the schedule still that of --steps (a rerun up to a step); 0: all",
    )
    p.add_argument(
        "--fingerprint-steps",
        type=_fingerprint_steps,
        default=[],
        metavar="STEPS",
        help="hash every parameter and gradient at these steps: 1,5,10 or all",
    )
    return p


def check_step_flags(cfg: Any) -> None:
    """--trace-step and --stop-after name a step of the run (0: off), in one line if not."""
    for flag in ("trace_step", "stop_after"):
        value = getattr(cfg, flag)
        if value < 0 or value > cfg.steps:
            name = "--" + flag.replace("_", "-")
            raise SystemExit(f"error: {name} must be in 0..{cfg.steps}, got {value}")


def _fingerprint_steps(text: str) -> list[int] | str:
    from parity.record.digest import parse_steps

    try:
        return parse_steps(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def config_from_args(config_cls: type, args: argparse.Namespace) -> Any:
    """The config dataclass from parsed flags of the same names (plus packed and the tokenizer)."""
    from worker.data.charcount import TOKENIZER_DIR

    names = {f.name for f in dataclasses.fields(config_cls)}
    values = {k: v for k, v in vars(args).items() if k in names}
    values["packed"] = not args.padded
    if args.tokenizer is None:
        has_own = (args.model / "tokenizer.json").exists()
        values["tokenizer"] = args.model if has_own else TOKENIZER_DIR
    return config_cls(**values)
