"""The SFT trainer rebuilt on TrainingWorker, with the fixed validation loss.

val/loss here is the token-weighted mean NLL over the whole val set: every val sample is used
(uneven rank shares allowed), and every micro-batch loss is normalized by the val set's global
loss-token count, so the sum over micro-batches and ranks is the mean over all loss tokens.
"""

from __future__ import annotations

import functools

from worker.losses import sft_loss
from worker.trainers.sft_common import SFTJob
from worker.training_worker import TrainingWorker


class SFTTrainer:
    def __init__(self, job: SFTJob):
        self.job = job
        self.worker = TrainingWorker(job.engine, job.cfg.batching())
        self.loss_fn = functools.partial(sft_loss, mode=job.cfg.loss_agg_mode)

    def train_step(self, step: int, samples: list) -> dict:
        """One optimizer step on this rank's share: the worker's fused step."""
        return self.worker.train_batch(samples, self.loss_fn)

    def validate(self) -> float:
        d = self.job.dist
        return self.worker.forward(self.job.val[d.rank :: d.world], self.loss_fn)["loss"]

    def fit(self) -> None:
        job, cfg = self.job, self.job.cfg
        start_step = 1
        if cfg.resume is not None:
            start_step = self.worker.load_state(cfg.resume)["next_step"]
            job.log.resume_at(start_step)
        elif cfg.val_before_train:
            job.log.log(0, {"val/loss": self.validate()})
        for step, epoch, samples in job.rank_batches(start_step):
            out = self.train_step(step, samples)
            metrics = {f"train/{k}": v for k, v in out["metrics"].items()}
            if job.is_val_step(step):
                metrics["val/loss"] = self.validate()
            job.log.log(step, metrics, {"epoch": epoch, "per_rank": out["per_rank"]})
            if step in cfg.save_state_at:
                self.worker.save_state(cfg.out / f"state_step{step}", {"next_step": step + 1})
