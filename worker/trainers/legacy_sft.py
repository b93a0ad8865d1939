"""The legacy SFT trainer: the pre-refactor design, kept faithful on purpose.

It drives the engine directly with its own micro-batch loop, its own loss normalization and its
own metric code, and it still has the old validation-loss formula (mean of the micro-batch
losses), selectable with `--val-loss legacy`. It is the "before" side of every parity claim:
do not make it share the TrainingWorker's code.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler

from worker.data.batching import make_micro_batches
from worker.losses import token_nll
from worker.trainers.sft_common import SFTJob

CPU_PEAK_FLOPS = 1e12


class LegacySFTTrainer:
    def __init__(self, job: SFTJob):
        self.job = job
        self.engine = job.engine
        self.cfg = job.cfg
        self.device = job.dist.device
        self.dp = job.dist.world
        self.total_tokens = 0

    def _loss_tokens(self, mbs) -> float:
        local = float(sum(int(mb.loss_mask.sum()) for mb in mbs))
        n = torch.tensor([local], dtype=torch.float64, device=self.device)
        dist.all_reduce(n)
        return float(n.item())

    def _micro_batch_loss(self, mb, n_tokens: float) -> torch.Tensor:
        if self.cfg.loss_agg_mode != "token-mean":
            raise SystemExit(
                "error: the legacy SFT trainer supports only --loss-agg-mode token-mean"
            )
        logits = self.engine.forward(mb)
        nll = token_nll(logits, mb.labels)
        mask = mb.loss_mask.reshape(-1).to(nll.dtype)
        return (nll * mask).sum() / n_tokens * self.dp

    def train_step(self, samples) -> dict:
        start = time.perf_counter()
        self.engine.zero_grad()
        mbs = make_micro_batches(samples, self.cfg.batching(), self.device)
        n_tokens = self._loss_tokens(mbs)
        step_loss = 0.0
        for mb in mbs:
            loss = self._micro_batch_loss(mb, n_tokens)
            loss.backward()
            step_loss += loss.item()
        grad_norm = self.engine.clip_grad_norm()
        if not torch.isfinite(grad_norm):
            print(f"WARN: grad_norm is not finite: {grad_norm}")
        self.engine.step(grad_norm)
        lr = self.engine.optimizer.param_groups[0]["lr"]

        loss_t = torch.tensor([step_loss], dtype=torch.float64, device=self.device)
        dist.all_reduce(loss_t)
        local = float(sum(mb.num_tokens for mb in mbs))
        tokens = torch.tensor([local], dtype=torch.float64, device=self.device)
        dist.all_reduce(tokens)
        global_tokens = float(tokens.item())
        self.total_tokens += global_tokens
        elapsed = time.perf_counter() - start
        flops = 6.0 * self.engine.num_params * global_tokens
        return {
            "train/loss": loss_t.item() / self.dp,
            "train/grad_norm": grad_norm.item(),
            "train/lr": lr,
            "train/global_tokens": global_tokens,
            "train/total_tokens(B)": self.total_tokens / 1e9,
            "train/mfu": flops / (CPU_PEAK_FLOPS * self.dp * elapsed),
        }

    @torch.no_grad()
    def validate(self) -> float:
        if self.cfg.val_loss == "legacy":
            return self._validate_old()
        return self._validate_fixed()

    def _validate_old(self) -> float:
        """The pre-fix formula: every micro-batch loss in one list, then its mean.

        Too small by the average number of micro-batches per val batch; right only with one.
        """
        val, dp, rank = self.job.val, self.dp, self.job.dist.rank
        per_rank = self.cfg.global_batch_size // dp
        sampler = DistributedSampler(
            range(len(val)), num_replicas=dp, rank=rank, shuffle=False, drop_last=True
        )
        order = list(sampler)
        if len(order) < per_rank:
            raise SystemExit(
                f"error: val set of {len(val)} samples is smaller than one batch of "
                f"{self.cfg.global_batch_size}: the legacy val-loss formula (drop_last) gives NaN"
            )
        losses = []
        for start in range(0, len(order) - per_rank + 1, per_rank):
            samples = [val[i] for i in order[start : start + per_rank]]
            mbs = make_micro_batches(samples, self.cfg.batching(), self.device)
            n_tokens = self._loss_tokens(mbs)
            for mb in mbs:
                losses.append(self._micro_batch_loss(mb, n_tokens).item())
        val_loss = torch.tensor(losses, dtype=torch.float64).mean().reshape(1)
        dist.all_reduce(val_loss)
        return val_loss.item() / dp

    def _validate_fixed(self) -> float:
        """The fixed value: token-weighted mean NLL over the whole val set, no sample dropped."""
        samples = self.job.val[self.job.dist.rank :: self.dp]
        mbs = make_micro_batches(samples, self.cfg.batching(), self.device)
        n_tokens = self._loss_tokens(mbs)
        total = 0.0
        for mb in mbs:
            total += self._micro_batch_loss(mb, n_tokens).item()
        t = torch.tensor([total], dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return t.item() / self.dp

    def fit(self) -> None:
        job = self.job
        if self.cfg.val_before_train:
            job.log.log(0, {"val/loss": self.validate()})
        for step, epoch, samples in job.rank_batches():
            metrics = self.train_step(samples)
            if job.is_val_step(step):
                metrics["val/loss"] = self.validate()
            job.log.log(step, metrics, {"epoch": epoch})
