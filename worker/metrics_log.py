"""What a job writes: exact JSONL metrics, verl-style console lines and a manifest (rank 0), and
every rank's own record for `parity.judge.diagnose` (JobLog), all through the recorder any training
loop uses (`parity.record`): one way to write a run.

Floats go through Python's json (shortest repr, round-trips bit for bit; NaN/Infinity spelled as
Python writes them). The last JSONL line is `{"event": "end", "steps": N}` only when the run
finished, so a run killed halfway is readable and visibly incomplete.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from parity.record import Recorder
from parity.record.env import CPU_ISA, cpu_facts, environment, git_revision, run_manifest
from parity.record.files import console_line, write_json_atomic

if TYPE_CHECKING:
    from collections.abc import Mapping

    from worker.engine import Engine

__all__ = [
    "CPU_ISA",
    "JobLog",
    "MetricsLog",
    "console_line",
    "cpu_facts",
    "environment",
    "git_revision",
    "write_json_atomic",
    "write_manifest",
]


class MetricsLog:
    """Rank 0 appends one record per step to metrics.jsonl and console.log; other ranks hold a
    no-op log."""

    def __init__(self, out_dir: Path, enabled: bool, append: bool = False):
        self.enabled = enabled
        self.recorder = Recorder(
            out_dir, rank=0, metrics=enabled, console=enabled, ranks=False, append=append
        )

    def resume_at(self, step: int) -> None:
        """Drop what a resumed run will log again (records from `step` on, the end record), so
        a run resumed into its own folder reads as one clean run."""
        self.recorder.resume_at(step)

    def log(self, step: int, metrics: dict[str, float], meta: dict | None = None) -> None:
        self.recorder.log(step, metrics, meta)

    def finish(self, steps: int) -> None:
        self.recorder.finish(steps)

    def close(self) -> None:
        self.recorder.close()


class JobLog(MetricsLog):
    """metrics.jsonl as before (rank 0, unchanged), plus what `parity.judge.diagnose` reads.

    Every rank writes ranks/rank{r}.jsonl: its own post-reduction metrics (which must equal rank
    0's bit for bit) and, in `_meta.data`, the digest of what it ran that step (the engines share
    one `DataDigest`). Rank 0 writes fingerprints.jsonl at the --fingerprint-steps: every
    engine's tensors under its prefix ("" for SFT's one model; "actor." and "critic." in PPO).
    Both end with an end record like metrics.jsonl, so a killed run's files read as incomplete.
    """

    def __init__(
        self, out_dir: Path, rank: int, engines: Mapping[str, Engine], append: bool = False
    ):
        self.engines = dict(engines)
        digests = {id(e.data_digest): e.data_digest for e in self.engines.values()}
        self.digests = [d for d in digests.values() if d is not None]
        self.enabled = rank == 0
        # the engines hash their own tensors at their chosen steps; the recorder writes them
        chosen = [e.fingerprint_steps for e in self.engines.values() if e.fingerprint_steps]
        steps = chosen[0] if chosen else []
        self.recorder = Recorder(
            out_dir, rank=rank, fingerprint_steps=steps, console=True, append=append
        )

    def log(self, step: int, metrics: dict[str, float], meta: dict | None = None) -> None:
        data = {k: v for digest in self.digests for k, v in digest.take().items()}
        for prefix, engine in self.engines.items():
            self.recorder.add_fingerprint(step, engine.fingerprints.pop(step, None), prefix)
        self.recorder.log(step, metrics, meta, data=data)


def write_manifest(cfg, d, determinism: dict, data_files: dict[str, Path], **extra: Any) -> None:
    """The run manifest: full config, versions, device, backend, world size, determinism flags,
    hashes of the data and the initial weights, and the git revision of this code."""
    from dataclasses import asdict

    from worker.model import file_sha256, weights_sha256

    manifest = run_manifest(
        config={k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()},
        device=str(d.device),
        backend=d.backend,
        world_size=d.world,
        determinism=determinism,
        code_dir=Path(__file__).resolve().parents[1],
        data_sha256={name: file_sha256(path) for name, path in data_files.items()},
        initial_weights_sha256=weights_sha256(cfg.model),
        **extra,
    )
    write_json_atomic(cfg.out / "manifest.json", manifest)
