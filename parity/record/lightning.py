"""The recorder as a Lightning logger: a LightningModule's `self.log(...)` values written into
the run folder the harness reads.

    from parity.record.lightning import ParityLogger

    trainer = Trainer(logger=ParityLogger("runs/a"), ...)   # on every rank, as Trainer is
    trainer.fit(model, data)

What it writes into `out` (Recorder's files, parity.record.recorder):
- metrics.jsonl (rank 0): each `log_metrics` call Lightning makes, at Lightning's step, the
  values as logged (`self.log("train/loss", loss, sync_dist=True)` for a value all ranks agree
  on); Lightning adds `epoch` to every call: a key the step already has with the same value is
  left out, with another value it is refused (ValueError), as the readers would refuse the run;
  the end record when `fit` ends with success;
- manifest.json (rank 0): the hyperparameters Lightning logs (`save_hyperparameters()`) as the
  config, the environment fingerprint, device, backend and world size;
- ranks/rank{r}.jsonl: every rank's logged values and the digest of the batches it passed to
  `self.logger.recorder.batch(...)` since its last log (a logger sees no batches by itself).

Imports Lightning (`lightning.pytorch`, else `pytorch_lightning`) when this module is imported;
`parity.record` itself needs only torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

try:
    from lightning.pytorch.loggers import Logger
except ImportError:
    from pytorch_lightning.loggers import Logger

from parity.record.recorder import Recorder
from parity.record.tracking import RecordingLogger


class ParityLogger(RecordingLogger, Logger):
    """Writes the run folder of a Lightning run (module doc). ParityLogger(out, manifest=...):
    out the run folder, manifest extra fields for manifest.json. `recorder` (every rank, made
    when first used, once Lightning has formed the process group) takes `batch(...)` calls for
    the batch digests."""

    @property
    def name(self) -> str:
        return "parity"

    @property
    def version(self) -> int:
        return 0

    @property
    def save_dir(self) -> str:
        return str(self.out)

    @property
    def log_dir(self) -> str:
        return str(self.out)

    @property
    def experiment(self) -> Recorder:
        return self.recorder

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        """The run's config in manifest.json (rewritten with what is logged later)."""
        self._add_config(params if isinstance(params, Mapping) else vars(params))

    def log_metrics(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        self._log_step(step, metrics, "log_metrics needs a step")

    def finalize(self, status: str) -> None:
        """The end records when training succeeded; otherwise the files closed without them
        (the run reads as incomplete)."""
        self._end(status == "success")
