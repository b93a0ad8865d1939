"""The recorder as an accelerate tracker: `accelerator.log(...)` values written into the run
folder the harness reads.

    from parity.record.accelerate import ParityTracker

    accelerator = Accelerator(log_with=[ParityTracker("runs/a")])
    accelerator.init_trackers("my-run", config=vars(args))   # manifest.json, with the config
    ...
    accelerator.log({"train/loss": mean_loss, "train/lr": lr}, step=step)
    ...
    accelerator.end_training()                               # the end record

accelerate runs trackers on the main process only: rank 0 writes metrics.jsonl (each `log`,
at its `step`, which it needs: runs are compared by step; numbers only, strings left out; a key
the step already has with the same value left out, another value refused), manifest.json (the
config `init_trackers` gives, the environment fingerprint, device, backend, world size) and
its own ranks/rank0.jsonl, with the digest of the batches given to
`accelerator.get_tracker("parity", unwrap=True).batch(...)` (the Recorder). Per-rank digests of
every rank need the recorder itself on every rank (parity.record.record_run).

Imports accelerate when this module is imported; `parity.record` itself needs only torch.
"""

from __future__ import annotations

from typing import Any

from accelerate.tracking import GeneralTracker

from parity.record.recorder import Recorder
from parity.record.tracking import RecordingLogger


class ParityTracker(RecordingLogger, GeneralTracker):
    """Writes the run folder of an accelerate run (module doc). ParityTracker(out, manifest=...):
    out the run folder, manifest extra fields for manifest.json."""

    name = "parity"
    requires_logging_directory = False
    main_process_only = True

    @property
    def tracker(self) -> Recorder:
        """The Recorder (`get_tracker("parity", unwrap=True)`), made at first use, once the
        process group whose rank and world size it records is formed."""
        return self.recorder

    def start(self) -> None:
        """The files and the manifest, when init_trackers runs."""
        _ = self.recorder

    def store_init_configuration(self, values: dict) -> None:
        """The run's config in manifest.json."""
        self._add_config(values)

    def log(self, values: dict, step: int | None = None, **kwargs: Any) -> None:
        self._log_step(step, values, "accelerator.log(values, step=N)")

    def finish(self) -> None:
        """The end records (accelerator.end_training): the run is complete."""
        self._end(True)
