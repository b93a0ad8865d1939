"""The run folder's names: every file and folder a job writes for the harness to read, in one place.

The run folder is the contract between whatever writes it (the recorder in the user's ranks, the
reference subject's jobs, a trainer of the user's own that writes it by hand) and the harness that
reads it (readers, judge, run, report). Both sides name its entries only through this module, so
the two can never drift apart; docs/run-folder.md describes the same folder for people who write
one without the recorder.

    RUN/metrics.jsonl           METRICS       rank 0: a record per logged step, then the end record
    RUN/manifest.json           MANIFEST      rank 0: config, environment, device, backend, world
    RUN/console.log             CONSOLE       rank 0, optional: verl-style `step:N - key:value`
    RUN/ranks/rank{r}.jsonl     RANKS_DIR     every rank: its own metrics and batch digests
    RUN/fingerprints.jsonl      FINGERPRINTS  rank 0, chosen steps: parameter and gradient hashes
    RUN/ops/rank{r}.jsonl, .pt  OPS_DIR       every rank, one traced step: each op's output hash

Only the standard library is imported: the recorder (which imports nothing of parity outside
parity.record) and the harness's lowest layers both use it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

__all__ = [
    "CONSOLE",
    "FINGERPRINTS",
    "MANIFEST",
    "METRICS",
    "OPS_DIR",
    "OP_VALUES_SUFFIX",
    "RANKS_DIR",
    "RANK_FILE",
    "console_path",
    "fingerprints_path",
    "manifest_path",
    "metrics_path",
    "numbered_files",
    "op_trace_paths",
    "ops_dir",
    "rank_file_name",
    "rank_path",
    "ranks_dir",
]

#: Written by rank 0 (the recorder's `log`, the reference subject's JobLog, HF's callback, the
#: Lightning logger, the accelerate tracker): one JSON object per line, `{"step": N, "name":
#: value, ...}` with floats in Python's shortest repr, then `{"event": "end", ...}` last. The
#: metrics every comparison reads; a file without the end record is an incomplete run.
METRICS = "metrics.jsonl"

#: Written by rank 0, once, atomically (`Recorder.manifest`): the config, the environment
#: fingerprint golden baselines are keyed on (torch, CUDA, device), backend, world size,
#: determinism flags, the git revision. Read by goldens, the report's environment table and
#: `Run.manifest`; its presence beside METRICS also marks the file as the recorder's.
MANIFEST = "manifest.json"

#: Written by rank 0 when asked (`Recorder(console=True)`): the same metrics as verl prints them,
#: `step:N - key:value - ...`; optional, read by the verl console reader when named.
CONSOLE = "console.log"

#: The folder every rank writes its own file into (RANK_FILE): the rank's post-reduction metrics
#: (METRICS's format) and, in `_meta.data`, the digests of the batches it ran. Read by the
#: diagnosis: which rank disagrees, whether the batches differ.
RANKS_DIR = "ranks"

#: One rank's file in RANKS_DIR and in OPS_DIR, `{rank}` its rank: rank0.jsonl, rank1.jsonl, ...
RANK_FILE = "rank{rank}.jsonl"

#: Written by rank 0 at the recorder's `fingerprint_steps`: one record a step, `{"step": N,
#: "params": {name: hash}, "grads": {name: hash or null}}`, then the end record. Read by the
#: diagnosis to name the first differing tensor.
FINGERPRINTS = "fingerprints.jsonl"

#: The folder `trace_ops` writes around one step, every rank its own RANK_FILE (one record per
#: aten op, then the end record) and beside it the kept output values (OP_VALUES_SUFFIX). Read
#: by parity.judge.opdiff: the first op whose output differs.
OPS_DIR = "ops"

#: The suffix of a rank's kept op outputs in OPS_DIR (rank0.pt, read with weights_only=True).
OP_VALUES_SUFFIX = ".pt"

#: The op namespaces of collectives in an op trace: their outputs are recorded without a hash
#: (written asynchronously), and their result reaches the trace through ``later``.
COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional", "_dtensor", "fsdp")


def is_collective(op: str) -> bool:
    """Whether an op trace's op name (``c10d.allreduce_.default``) is a collective's."""
    return op.split(".")[0] in COLLECTIVE_NAMESPACES


_RANK_FILE = re.compile(re.escape(RANK_FILE).replace(re.escape("{rank}"), r"(\d+)"))

PathLike = str | os.PathLike[str]


def metrics_path(run_dir: PathLike) -> Path:
    """RUN/metrics.jsonl."""
    return Path(run_dir) / METRICS


def manifest_path(run_dir: PathLike) -> Path:
    """RUN/manifest.json."""
    return Path(run_dir) / MANIFEST


def console_path(run_dir: PathLike) -> Path:
    """RUN/console.log."""
    return Path(run_dir) / CONSOLE


def fingerprints_path(run_dir: PathLike) -> Path:
    """RUN/fingerprints.jsonl."""
    return Path(run_dir) / FINGERPRINTS


def ranks_dir(run_dir: PathLike) -> Path:
    """RUN/ranks."""
    return Path(run_dir) / RANKS_DIR


def ops_dir(run_dir: PathLike) -> Path:
    """RUN/ops."""
    return Path(run_dir) / OPS_DIR


def rank_file_name(rank: int) -> str:
    """rank{rank}.jsonl: one rank's file in ranks/ and ops/."""
    return RANK_FILE.format(rank=rank)


def rank_path(run_dir: PathLike, rank: int) -> Path:
    """RUN/ranks/rank{rank}.jsonl."""
    return ranks_dir(run_dir) / rank_file_name(rank)


def op_trace_paths(run_dir: PathLike, rank: int) -> tuple[Path, Path]:
    """RUN/ops/rank{rank}.jsonl (the op records) and RUN/ops/rank{rank}.pt (the kept values)."""
    jsonl = ops_dir(run_dir) / rank_file_name(rank)
    return jsonl, jsonl.with_suffix(OP_VALUES_SUFFIX)


def numbered_files(folder: PathLike) -> dict[int, Path]:
    """rank -> file of the rank files (RANK_FILE) in `folder` (ranks/ or ops/), by rank; {} when
    the folder does not exist. Other entries are not the harness's and are left alone. Raises
    OSError when the folder exists but cannot be listed."""
    folder = Path(folder)
    if not folder.is_dir():
        return {}
    found = {}
    for p in folder.iterdir():
        m = _RANK_FILE.fullmatch(p.name)
        if m:
            found[int(m.group(1))] = p
    return dict(sorted(found.items()))
