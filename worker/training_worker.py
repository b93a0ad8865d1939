"""TrainingWorker: Tinker's API over one engine, and the one place metrics are reduced.

    worker.zero_grad()                              -> a new step: gradients and step totals cleared
    worker.loss_scale(batch)                        -> the step's normalizer: global counts of batch
    worker.forward_backward(batch, loss_fn, scale)  -> gradients accumulate; loss, log-probs
    worker.optim_step(params=None)                  -> clip, AdamW step: grad_norm, lr, step totals
    worker.train_batch(batch, loss_fn)              -> the fused step: the three above in one call
    worker.forward(batch, loss_fn)                  -> evaluation without gradients; log-probs
    worker.save_state(path) / load_state(path)

`batch` is this rank's share (a list of encoded samples); every rank calls each method together,
as with any collective.

A step may take any number of forward_backward calls. Their normalization is a step-level
normalizer declared up front (`loss_scale` of the whole step, passed to every call), not
Tinker's per-token weights: each micro-batch loss is then sum(nll * mask) / N * dp, the very
float operations of the fused step and of the legacy trainer, so k calls whose chunks are whole
micro-batches of the fused split give the fused step's gradients bit for bit. Per-token weights
w = dp / N would round every product w * nll on its own: the same value in exact arithmetic,
other bits. A call without a declared scale normalizes by its own global counts, which is the
whole step only when it is the step's one call: a second such call in a step is refused.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from worker.data.batching import (
    BatchingConfig,
    MicroBatch,
    global_counts,
    global_sample_counts,
    make_micro_batches,
    micro_batch_members,
)
from worker.data.charcount import Encoded
from worker.distributed import Dist, all_reduce_sum
from worker.engine import Engine
from worker.losses import LossScale

# (logits, micro-batch, scale) -> (loss, metrics). Float metrics are reduced like the loss; a
# loss fn may put its per-token log-probs (flat [T], label-aligned) in metrics["logprobs"], which
# forward_backward and forward return per sample.
LossFn = Callable[[torch.Tensor, MicroBatch, LossScale], tuple[torch.Tensor, dict]]

PEAK_FLOPS_PER_DEVICE = {"cpu": 1e12, "cuda": 989e12}  # nominal; mfu is a timing metric anyway


@dataclass(frozen=True)
class AdamParams:
    """Tinker's AdamParams: AdamW's settings for one optim_step, chosen by the client.

    grad_clip_norm 0.0 means no clipping (Tinker's convention). Tinker's defaults.
    """

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0


class TrainingWorker:
    def __init__(self, engine: Engine, batching: BatchingConfig):
        self.engine, self.batching = engine, batching
        self.dist: Dist = engine.dist
        self.total_tokens = 0.0
        self._reset_step()

    # --- Tinker-like API ------------------------------------------------------------------------
    def zero_grad(self) -> None:
        """Start a step: no gradient and no step total carried over."""
        self.engine.zero_grad()
        self._reset_step()

    def loss_scale(self, batch: list[Encoded]) -> LossScale:
        """The normalizer of a step over `batch` (this rank's share of the whole step), to pass
        to each of the step's forward_backward calls. Collective."""
        tokens, seqs, _ = global_sample_counts(batch, self.dist.device)
        return LossScale(tokens, seqs, self.dist.world, self.batching.horizon)

    def forward_backward(
        self, batch: list[Encoded], loss_fn: LossFn, scale: LossScale | None = None
    ) -> dict:
        """Forward and backward over every micro-batch; gradients accumulate until optim_step.

        scale: the step's declared normalizer (`loss_scale`); None normalizes by this call's own
        global counts, right only for a step's one call. Returns this call's share of the step
        loss (averaged over ranks), its reduced metrics and per-sample log-probs (`logprobs`, one
        tensor per sample of `batch`, label-aligned; None if the loss fn gives none).

        A call that fails clears the gradients and the step totals, so neither a retry nor the
        next step adds to stale ones (verl's TinkerTrainingWorker does the same).
        """
        try:
            if self._step_calls and (scale is None or self._step_self_normalized):
                raise ValueError(
                    "forward_backward: a second call in one step needs the step's declared "
                    "normalizer in every call (scale=worker.loss_scale(whole step)); each call "
                    "normalized by its own tokens would not add up to the step's loss"
                )
            out = self._run(batch, loss_fn, backward=True, declared=scale)
        except BaseException:
            self.zero_grad()
            raise
        self._step_calls += 1
        self._step_self_normalized = scale is None
        self._step_losses += out["micro_batch_losses"]
        self._step_metrics += out["micro_batch_metrics"]
        self._step_tokens += out["global_tokens"]
        self._step_micro_batches += out["local"]["num_micro_batches"]
        self._step_loss_tokens += out["local"]["loss_tokens"]
        return out

    def optim_step(self, params: AdamParams | None = None) -> dict:
        """One AdamW step on what the step's forward_backward calls accumulated.

        params None: the engine's settings and its internal schedule; the scheduler steps and
        `lr` is its rate after the step. params given (Tinker's AdamParams): lr, betas, eps and
        weight decay are set for this step, the norm is clipped at params.grad_clip_norm (0: not
        clipped), the scheduler is left alone and `lr` is params.learning_rate.

        Returns grad_norm (global, pre-clip), lr, applied, and the step's totals over all its
        calls, reduced as the fused step reduces them: loss, metrics, global_tokens, per_rank.
        """
        max_norm = None
        if params is not None:
            betas = (params.beta1, params.beta2)
            self.engine.set_optim_params(
                params.learning_rate, betas, params.eps, params.weight_decay
            )
            max_norm = params.grad_clip_norm or float("inf")
        grad_norm = self._clip_grad_norm(max_norm)
        applied = self.engine.step(grad_norm, schedule=params is None)
        lr = self.engine.current_lr() if params is None else params.learning_rate
        totals = {
            "loss": self.reduce_mean_over_ranks(sum(self._step_losses)),
            "metrics": self.reduce_micro_batch_metrics(self._step_metrics),
            "global_tokens": self._step_tokens,
            "per_rank": self.gather(
                {
                    "num_micro_batches": self._step_micro_batches,
                    "loss_tokens": self._step_loss_tokens,
                    "forward_backward_calls": self._step_calls,
                }
            ),
        }
        self.total_tokens += self._step_tokens
        self._reset_step()
        return {"grad_norm": float(grad_norm), "lr": lr, "applied": applied, **totals}

    def train_batch(self, batch: list[Encoded], loss_fn: LossFn) -> dict:
        """The fused step: zero_grad, one forward_backward, optim_step with the internal
        schedule; returns the step's metrics (no prefix)."""
        start = time.perf_counter()
        self.zero_grad()
        self.forward_backward(batch, loss_fn)
        step = self.optim_step()
        return {"metrics": self.step_metrics(step, time.perf_counter() - start),
                "per_rank": step["per_rank"]}  # fmt: skip

    def step_metrics(self, step: dict, elapsed: float) -> dict:
        """The logged metrics of one optim_step's result, in verl's order."""
        return {
            "loss": step["loss"],
            "grad_norm": step["grad_norm"],
            "lr": step["lr"],
            "mfu": self.mfu(step["global_tokens"], elapsed),  # ahead of the counters, as in verl
            "global_tokens": step["global_tokens"],
            "total_tokens(B)": self.total_tokens / 1e9,
        }

    @torch.no_grad()
    def forward(self, batch: list[Encoded], loss_fn: LossFn) -> dict:
        """Evaluate without gradients: the loss normalized over this whole (global) batch, and
        per-sample log-probs as forward_backward returns them."""
        out = self._run(batch, loss_fn, backward=False, declared=None)
        out["per_rank"] = self.gather(out["local"])
        return out

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

    # --- internals ------------------------------------------------------------------------------
    def _reset_step(self) -> None:
        self._step_calls = 0
        self._step_self_normalized = False
        self._step_losses: list[float] = []
        self._step_metrics: list[dict] = []
        self._step_tokens = 0.0
        self._step_micro_batches = 0
        self._step_loss_tokens = 0

    def _call_scale(self, own: LossScale, declared: LossScale | None) -> LossScale:
        """The normalizer a call uses: the step's declared one, else the call's own counts."""
        return own if declared is None else declared

    def _clip_grad_norm(self, max_norm: float | None) -> torch.Tensor:
        return self.engine.clip_grad_norm(max_norm)

    def _run(
        self, batch: list[Encoded], loss_fn: LossFn, backward: bool, declared: LossScale | None
    ) -> dict:
        device = self.dist.device
        mbs = make_micro_batches(batch, self.batching, device)
        tokens, seqs, attn = global_counts(mbs, device)
        own = LossScale(tokens, seqs, self.dist.world, self.batching.horizon)
        scale = self._call_scale(own, declared)
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
            "local": {
                "num_micro_batches": len(mbs),
                "loss_tokens": sum(mb.num_loss_tokens for mb in mbs),
            },
            "logprobs": self._per_sample(batch, mbs, mb_metrics),
            "micro_batch_losses": mb_losses,
            "micro_batch_metrics": mb_metrics,
            "metrics": self.reduce_micro_batch_metrics(mb_metrics),
        }

    def _per_sample(
        self, batch: list[Encoded], mbs: list[MicroBatch], mb_metrics: list[dict]
    ) -> list[torch.Tensor] | None:
        """The micro-batches' per-token log-probs, cut back into the samples of `batch`."""
        if not mbs or any("logprobs" not in m for m in mb_metrics):
            return None
        out: list[torch.Tensor | None] = [None] * len(batch)
        members = micro_batch_members(batch, self.batching, len(mbs))
        for mb, metrics, idx in zip(mbs, mb_metrics, members, strict=True):
            values = metrics["logprobs"].detach().reshape(mb.labels.shape).cpu()
            if mb.attention_mask is None:  # packed: one row, the samples one after another
                pieces = values[0].split([len(batch[i]) for i in idx]) if idx else []
            else:  # padded: a row per sample
                pieces = [values[j, : len(batch[i])] for j, i in enumerate(idx)]
            for i, piece in zip(idx, pieces, strict=True):
                out[i] = piece
        return out  # type: ignore[return-value]

    # --- the one place metrics are reduced ------------------------------------------------------
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
