"""What a job writes: exact JSONL metrics, verl-style console lines and a manifest (rank 0), and
every rank's own record for `parity.diagnose` (JobLog).

Floats go through Python's json (shortest repr, round-trips bit for bit; NaN/Infinity spelled as
Python writes them). The last JSONL line is `{"event": "end", "steps": N}` only when the run
finished, so a run killed halfway is readable and visibly incomplete.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

    from worker.engine import Engine


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write to a temp file in the same folder, then rename: never a half-written file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, sort_keys=True, default=str)
        f.write("\n")
    os.replace(tmp, path)


def console_line(step: int, metrics: dict[str, float]) -> str:
    """verl's console format: `step:N - key:value - ...` with full repr precision."""
    return " - ".join([f"step:{step}"] + [f"{k}:{v!r}" for k, v in metrics.items()])


class MetricsLog:
    """Rank 0 appends one record per step; other ranks hold a no-op log."""

    def __init__(self, out_dir: Path, enabled: bool, append: bool = False):
        self.enabled = enabled
        self._jsonl: TextIO | None = None
        self._console: TextIO | None = None
        if enabled:
            out_dir.mkdir(parents=True, exist_ok=True)
            mode = "a" if append else "w"
            self._jsonl = open(out_dir / "metrics.jsonl", mode, encoding="utf-8")
            self._console = open(out_dir / "console.log", mode, encoding="utf-8")

    def resume_at(self, step: int) -> None:
        """Drop what a resumed run will log again (records from `step` on, the end record), so a
        run resumed into its own folder reads as one clean run."""
        if not self.enabled:
            return
        self.close()
        out_dir = Path(self._jsonl.name).parent
        _keep_before(out_dir / "metrics.jsonl", step, _jsonl_step)
        _keep_before(out_dir / "console.log", step, _console_step)
        self._jsonl = open(out_dir / "metrics.jsonl", "a", encoding="utf-8")
        self._console = open(out_dir / "console.log", "a", encoding="utf-8")

    def log(self, step: int, metrics: dict[str, float], meta: dict | None = None) -> None:
        if not self.enabled:
            return
        record: dict[str, Any] = {"step": step, **metrics}
        if meta:
            record["_meta"] = meta
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        line = console_line(step, metrics)
        self._console.write(line + "\n")
        self._console.flush()
        print(line, flush=True)

    def finish(self, steps: int) -> None:
        if self.enabled:
            self._jsonl.write(json.dumps({"event": "end", "steps": steps}) + "\n")
            self.close()

    def close(self) -> None:
        for f in (self._jsonl, self._console):
            if f is not None and not f.closed:
                f.close()


class JobLog(MetricsLog):
    """metrics.jsonl as before (rank 0, unchanged), plus what `parity.diagnose` reads.

    Every rank writes ranks/rank{r}.jsonl: its own post-reduction metrics (which must equal rank
    0's bit for bit) and, in `_meta.data`, the digest of what it ran that step (the engines share
    one `DataDigest`). Rank 0 writes fingerprints.jsonl at the --fingerprint-steps: every
    engine's tensors under its prefix ("" for SFT's one model; "actor." and "critic." in PPO).
    Both end with an end record like metrics.jsonl, so a killed run's files read as incomplete.
    """

    def __init__(
        self, out_dir: Path, rank: int, engines: Mapping[str, Engine], append: bool = False
    ):
        super().__init__(out_dir, enabled=rank == 0, append=append)
        self.engines = dict(engines)
        digests = {id(e.data_digest): e.data_digest for e in self.engines.values()}
        self.digests = [d for d in digests.values() if d is not None]
        mode = "a" if append else "w"
        (out_dir / "ranks").mkdir(parents=True, exist_ok=True)
        self._paths = [out_dir / "ranks" / f"rank{rank}.jsonl"]
        if rank == 0 and any(e.fingerprint_steps for e in self.engines.values()):
            self._paths.append(out_dir / "fingerprints.jsonl")
        self._files: list[TextIO] = [open(p, mode, encoding="utf-8") for p in self._paths]

    def log(self, step: int, metrics: dict[str, float], meta: dict | None = None) -> None:
        super().log(step, metrics, meta)
        data = {k: v for digest in self.digests for k, v in digest.take().items()}
        extra: dict[str, Any] = {"data": data}
        if meta and "epoch" in meta:
            extra["epoch"] = meta["epoch"]
        self._write(0, {"step": step, **metrics, "_meta": extra})
        fingerprint: dict[str, dict] = {}
        for prefix, engine in self.engines.items():
            taken = engine.fingerprints.pop(step, None)
            for key, hashes in (taken or {}).items():
                fingerprint.setdefault(key, {}).update({prefix + n: h for n, h in hashes.items()})
        if fingerprint and len(self._files) > 1:
            self._write(1, {"step": step, **fingerprint})

    def _write(self, i: int, record: dict) -> None:
        self._files[i].write(json.dumps(record) + "\n")
        self._files[i].flush()

    def resume_at(self, step: int) -> None:
        """Drop records from `step` on, as metrics.jsonl does, so a resumed run reads as one."""
        super().resume_at(step)
        for f in self._files:
            f.close()
        for path in self._paths:
            _keep_before(path, step, _jsonl_step)
        self._files = [open(p, "a", encoding="utf-8") for p in self._paths]

    def finish(self, steps: int) -> None:
        for i in range(len(self._files)):
            self._write(i, {"event": "end", "steps": steps})
        super().finish(steps)  # rank 0's end record last: metrics.jsonl says the run is done
        self.close()

    def close(self) -> None:
        super().close()
        for f in self._files:
            if not f.closed:
                f.close()


def write_manifest(cfg, d, determinism: dict, data_files: dict[str, Path], **extra) -> None:
    """The run manifest: full config, versions, device, backend, world size, determinism flags,
    hashes of the data and the initial weights, and the git revision of this code."""
    from dataclasses import asdict

    from worker.model import file_sha256, weights_sha256

    manifest = {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()},
        "environment": environment(),
        "device": str(d.device),
        "backend": d.backend,
        "world_size": d.world,
        "determinism": determinism,
        "data_sha256": {name: file_sha256(path) for name, path in data_files.items()},
        "initial_weights_sha256": weights_sha256(cfg.model),
        **extra,
        "git_revision": git_revision(Path(__file__).resolve().parents[1]),
    }
    write_json_atomic(cfg.out / "manifest.json", manifest)


def _keep_before(path: Path, step: int, step_of: Callable[[str], int | None]) -> None:
    """Rewrite `path` (temp file, then rename) with only its lines of a step before `step`:
    later steps, the end record and a truncated last line go."""
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    kept = [x for x in lines if (s := step_of(x)) is not None and s < step]
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.writelines(kept)
    os.replace(tmp, path)


def _jsonl_step(line: str) -> int | None:
    try:
        return json.loads(line).get("step")
    except ValueError:
        return None  # a truncated last line of a killed run


def _console_step(line: str) -> int | None:
    head = line.split(" - ", 1)[0]
    return int(head[5:]) if head.startswith("step:") and head[5:].isdigit() else None


def git_revision(path: Path) -> str | None:
    try:
        out = subprocess.run(
            ["git", "-C", str(path), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    dirty = subprocess.run(
        ["git", "-C", str(path), "status", "--porcelain", "--untracked-files=no"],
        capture_output=True,
        text=True,
        timeout=10,
    ).stdout.strip()
    return out.stdout.strip() + ("+dirty" if dirty else "")


# instruction sets the BLAS dispatches on: x86, then arm (32-bit `neon`, 64-bit `asimd` on)
CPU_ISA = ("avx512f", "avx512_bf16", "amx_tile", "avx2", "fma")
CPU_ISA += ("neon", "asimd", "sve", "sve2", "bf16", "i8mm")


def cpu_facts(cpuinfo: str) -> dict[str, Any]:
    """`cpu_isa`, `cpu_vendor` and `cpu_model` from /proc/cpuinfo's first processor (x86 or arm):
    the BLAS picks its kernels by them, so two hosts apart in them may sum in other orders."""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if not key.strip():
            break  # the end of the first processor's block
        fields.setdefault(key.strip(), value.strip())
    flags = set(fields.get("flags", fields.get("Features", "")).split())
    return {
        "cpu_isa": [f for f in CPU_ISA if f in flags],
        "cpu_vendor": fields.get("vendor_id") or fields.get("CPU implementer"),
        "cpu_model": fields.get("model name") or fields.get("CPU part"),
    }


def environment() -> dict[str, Any]:
    """Versions and machine facts that decide whether two runs can be bitwise equal."""
    import torch
    import transformers

    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = cpu_facts(f.read())
    except OSError:
        cpu = cpu_facts("")
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "platform": platform.platform(),
        "machine": platform.machine(),
        **cpu,
        "cuda": torch.version.cuda if torch.cuda.is_available() else None,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "argv": sys.argv,
    }
