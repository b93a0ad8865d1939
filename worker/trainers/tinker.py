"""The SFT trainer as a Tinker client: it drives the TrainingWorker call by call.

Each step: `zero_grad`; the step's normalizer declared once, from the whole step
(`loss_scale`); `forward_backward` on each of `--chunks` contiguous chunks of this rank's share;
`optim_step(AdamParams)` with the learning rate the client takes itself from the same
warmup-cosine schedule (`OptimConfig.lr_at`), so the engine's scheduler never steps.

Bitwise the fused step (`--trainer worker`) and the legacy trainer when every chunk is whole
micro-batches of the fused split (fixed micro-batches, chunk sizes multiples of their size: the
default 2 chunks of the default 8 samples per rank in micro-batches of 4); otherwise the
micro-batches differ, and with them the order of the sums (tests/worker/test_tinker_parity.py).
"""

from __future__ import annotations

import time

from worker.data.charcount import Encoded
from worker.engine import OptimConfig
from worker.trainers.sft import SFTTrainer
from worker.trainers.sft_common import SFTJob
from worker.training_worker import AdamParams


def split_chunks(samples: list[Encoded], k: int) -> list[list[Encoded]]:
    """k contiguous chunks of near-equal size (the first ones one longer); fewer if fewer
    samples. Every rank's share has the same size, so every rank makes the same calls."""
    k = max(1, min(k, len(samples)))
    size, extra = divmod(len(samples), k)
    bounds = [i * size + min(i, extra) for i in range(k + 1)]
    return [samples[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


def adam_params(optim: OptimConfig, step: int) -> AdamParams:
    """AdamW's settings for step `step` (1-based): its lr is the schedule's after step - 1
    scheduler steps, the rate the engine's own scheduler would have set; the rest as configured
    (the engine's clip is Tinker's grad_clip_norm, > 0 here)."""
    return AdamParams(
        learning_rate=optim.lr_at(step - 1),
        beta1=optim.betas[0],
        beta2=optim.betas[1],
        eps=optim.eps,
        weight_decay=optim.weight_decay,
        grad_clip_norm=optim.clip_grad,
    )


class TinkerSFTTrainer(SFTTrainer):
    def __init__(self, job: SFTJob):
        super().__init__(job)
        self.optim = job.cfg.optim()

    def train_step(self, step: int, samples: list[Encoded]) -> dict:
        start = time.perf_counter()
        worker = self.worker
        worker.zero_grad()
        scale = worker.loss_scale(samples)  # the whole step's counts, declared up front
        for chunk in split_chunks(samples, self.job.cfg.chunks):
            worker.forward_backward(chunk, self.loss_fn, scale=scale)
        out = worker.optim_step(adam_params(self.optim, step))
        metrics = worker.step_metrics(out, time.perf_counter() - start)
        # train/lr is the rate after the step (what the next step uses), as the fused side logs
        metrics["lr"] = self.optim.lr_at(step)
        return {"metrics": metrics, "per_rank": out["per_rank"]}
