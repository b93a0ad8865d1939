"""A 4-step Lightning run writing its run folder through parity.record.lightning.ParityLogger.

    torchrun --nproc-per-node 2 tests/jobs/lightning_run.py --out DIR [--lr 0.1]

DDP over 2 gloo ranks on CPU (Lightning reads torchrun's environment), a tiny next-token model on
random ids, an evaluation every 2 steps, the batch digests through `self.logger.recorder`.
tests/record/test_loggers.py runs it; `--lr` on one side is its planted change.
"""

from __future__ import annotations

import argparse
import os
import sys

import pytorch_lightning as pl
import torch
import torch.nn.functional as F

from parity.record.lightning import ParityLogger


class TinyLM(pl.LightningModule):
    def __init__(self, lr: float):
        super().__init__()
        self.save_hyperparameters()  # the manifest's config
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Embedding(32, 16), torch.nn.Linear(16, 32))

    def _loss(self, batch: torch.Tensor) -> torch.Tensor:
        x, y = batch[:, :-1], batch[:, 1:]
        return F.cross_entropy(self.net(x).flatten(0, 1), y.flatten())

    def training_step(self, batch: torch.Tensor, index: int) -> torch.Tensor:
        self.logger.recorder.batch(batch[:, :-1], batch[:, 1:])  # what this rank trains on
        loss = self._loss(batch)
        self.log("train/loss", loss, sync_dist=True)  # averaged over ranks: the same on each
        self.log("train/lr", self.hparams.lr)
        return loss

    def validation_step(self, batch: torch.Tensor, index: int) -> None:
        self.log("val/loss", self._loss(batch), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False)
    p.add_argument("--out", required=True)
    p.add_argument("--lr", type=float, default=0.1)
    args = p.parse_args()
    data = torch.randint(0, 32, (64, 9), generator=torch.Generator().manual_seed(1))
    train = torch.utils.data.DataLoader(data, batch_size=2)
    val = torch.utils.data.DataLoader(data[:8], batch_size=4)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_steps=4, logger=ParityLogger(args.out),
        log_every_n_steps=1, val_check_interval=2, num_sanity_val_steps=0,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(TinyLM(args.lr), train, val)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip gloo's interpreter teardown, which can abort (see foreign_loop.py)
