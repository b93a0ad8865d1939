"""TrainingWorker: a Tinker-like API over one engine, and the one place metrics are reduced.

    worker.forward_backward(batch, loss_fn)  -> accumulates gradients, returns loss and metrics
    worker.optim_step()                      -> clip, optimizer and scheduler step: grad_norm, lr
    worker.train_batch(batch, loss_fn)       -> both, plus token counters and mfu
    worker.forward(batch, loss_fn)           -> evaluation without gradients
    worker.save_state(path) / load_state(path)

`batch` is this rank's share of the global batch (a list of encoded samples); every rank calls
each method together, as with any collective.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from worker.data.batching import BatchingConfig, MicroBatch, global_counts, make_micro_batches
from worker.data.charcount import Encoded
from worker.distributed import Dist, all_reduce_sum
from worker.engine import Engine
from worker.losses import LossScale

LossFn = Callable[[torch.Tensor, MicroBatch, LossScale], tuple[torch.Tensor, dict]]

PEAK_FLOPS_PER_DEVICE = {"cpu": 1e12, "cuda": 989e12}  # nominal; mfu is a timing metric anyway


class TrainingWorker:
    def __init__(self, engine: Engine, batching: BatchingConfig):
        self.engine, self.batching = engine, batching
        self.dist: Dist = engine.dist
        self.total_tokens = 0.0

    # --- Tinker-like API ------------------------------------------------------------------------
    def forward_backward(self, batch: list[Encoded], loss_fn: LossFn) -> dict:
        """Forward and backward over every micro-batch; gradients accumulate until optim_step.

        A call that fails clears the gradients, so a retry never adds to stale ones.
        """
        try:
            return self._run(batch, loss_fn, backward=True)
        except BaseException:
            self.engine.zero_grad()
            raise

    def optim_step(self) -> dict:
        """Clip, then step optimizer and scheduler; grad_norm is the global pre-clip norm."""
        grad_norm = self.engine.clip_grad_norm()
        applied = self.engine.step(grad_norm)
        return {"grad_norm": float(grad_norm), "lr": self.engine.current_lr(), "applied": applied}

    def train_batch(self, batch: list[Encoded], loss_fn: LossFn) -> dict:
        """One optimizer step on a global batch; returns the step's metrics (no prefix)."""
        start = time.perf_counter()
        fb = self.forward_backward(batch, loss_fn)
        step = self.optim_step()
        elapsed = time.perf_counter() - start
        self.total_tokens += fb["global_tokens"]
        metrics = {
            "loss": fb["loss"],
            "grad_norm": step["grad_norm"],
            "lr": step["lr"],
            "mfu": self.mfu(fb["global_tokens"], elapsed),  # ahead of the counters, as in verl
            "global_tokens": fb["global_tokens"],
            "total_tokens(B)": self.total_tokens / 1e9,
        }
        return {"metrics": metrics, "per_rank": fb["per_rank"]}

    @torch.no_grad()
    def forward(self, batch: list[Encoded], loss_fn: LossFn) -> dict:
        """Evaluate without gradients: the loss normalized over this whole (global) batch."""
        return self._run(batch, loss_fn, backward=False)

    def save_state(self, path: str | Path, extra: dict | None = None) -> None:
        """Model, optimizer, scheduler, RNG and caller state (e.g. data position), atomically."""
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        if self.dist.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        dist.barrier()
        state = {"worker_total_tokens": self.total_tokens, **(extra or {})}
        self.engine.save(tmp, state)
        dist.barrier()
        if self.dist.rank == 0:
            shutil.rmtree(path, ignore_errors=True)
            os.replace(tmp, path)
        dist.barrier()

    def load_state(self, path: str | Path) -> dict:
        """Restore what save_state wrote; returns the caller state it was given."""
        extra = self.engine.load(Path(path))
        self.total_tokens = float(extra.pop("worker_total_tokens"))
        return extra

    # --- the one place metrics are reduced ------------------------------------------------------
    def _run(self, batch: list[Encoded], loss_fn: LossFn, backward: bool) -> dict:
        device = self.dist.device
        mbs = make_micro_batches(batch, self.batching, device)
        tokens, seqs, attn = global_counts(mbs, device)
        scale = LossScale(tokens, seqs, self.dist.world, self.batching.horizon)
        mb_losses: list[float] = []
        mb_metrics: list[dict] = []
        for mb in mbs:
            logits = self.engine.forward(mb)
            loss, metrics = loss_fn(logits, mb, scale)
            if backward:
                loss.backward()
            mb_losses.append(loss.item())
            mb_metrics.append(metrics)
        return {
            "loss": self.reduce_mean_over_ranks(sum(mb_losses)),
            "global_tokens": attn,
            "per_rank": self.gather(
                {
                    "num_micro_batches": len(mbs),
                    "loss_tokens": sum(mb.num_loss_tokens for mb in mbs),
                }
            ),
            "micro_batch_losses": mb_losses,
            "micro_batch_metrics": mb_metrics,
            "metrics": self.reduce_micro_batch_metrics(mb_metrics),
        }

    def reduce_micro_batch_metrics(self, mb_metrics: list[dict]) -> dict[str, float]:
        """The loss fn's float metrics (global-scaled shares, like the loss): summed over the
        micro-batches, then averaged over ranks. Keys sorted so every rank reduces in one order."""
        first = mb_metrics[0] if mb_metrics else {}
        keys = sorted(k for k, v in first.items() if isinstance(v, float))
        return {k: self.reduce_mean_over_ranks(sum(m[k] for m in mb_metrics)) for k in keys}

    def reduce_mean_over_ranks(self, value: float) -> float:
        """Sum over ranks in float64, divided by dp: the global value of a dp-scaled loss."""
        return float(all_reduce_sum(value, self.dist.device)) / self.dist.world

    def gather(self, metrics: dict) -> dict[str, list]:
        """Per-rank metrics, gathered (not reduced): name -> one value per rank."""
        out: list[dict | None] = [None] * self.dist.world
        dist.all_gather_object(out, metrics)
        return {k: [m[k] for m in out] for k in metrics}

    def mfu(self, tokens: float, elapsed: float) -> float:
        flops = 6.0 * self.engine.num_params * tokens
        peak = PEAK_FLOPS_PER_DEVICE[self.dist.device.type] * self.dist.world
        return flops / (peak * max(elapsed, 1e-9))
