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

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from accelerate.tracking import GeneralTracker

from parity.record.recorder import Recorder
from parity.record.tracking import StepMerger, numbers


class ParityTracker(GeneralTracker):
    """Writes the run folder of an accelerate run (module doc). out: the run folder; manifest:
    extra fields for manifest.json."""

    name = "parity"
    requires_logging_directory = False
    main_process_only = True

    def __init__(self, out: str | Path, *, manifest: Mapping[str, Any] | None = None):
        super().__init__()
        self.out = Path(out)
        self.manifest_extra = dict(manifest or {})
        self._config: dict[str, Any] = {}
        self._recorder: Recorder | None = None
        self._merger = StepMerger()

    @property
    def tracker(self) -> Recorder:
        """The Recorder (`get_tracker("parity", unwrap=True)`), made at first use, once the
        process group whose rank and world size it records is formed."""
        if self._recorder is None:
            self._recorder = Recorder(self.out)
            self._recorder.manifest(self._config, **self.manifest_extra)
        return self._recorder

    def start(self) -> None:
        """The files and the manifest, when init_trackers runs."""
        _ = self.tracker

    def store_init_configuration(self, values: dict) -> None:
        """The run's config in manifest.json."""
        self._config.update(values)
        self.tracker.manifest(self._config, **self.manifest_extra)

    def log(self, values: dict, step: int | None = None, **kwargs: Any) -> None:
        if step is None:
            raise ValueError(
                "ParityTracker: accelerator.log(values, step=N): runs are compared by step"
            )
        new = self._merger.new(step, numbers(values))
        if new:
            self.tracker.log(step, new)

    def finish(self) -> None:
        """The end records (accelerator.end_training): the run is complete."""
        if self._recorder is not None:
            self._recorder.finish()
