"""Golden baselines: exact metrics per environment, each with the fingerprint it was made in.

Bitwise equality is only promised within one environment (torch, CPU instruction set and vendor,
backend, device, world size...): the BLAS picks its kernels by CPU, so the same job sums in another
order on another host (seen: two x86_64 hosts, one with AMX, part at step 3). A golden is
therefore a folder with one baseline per environment, `<golden>/<baseline_name>/`, each a minimal
run folder (metrics.jsonl + manifest.json) that every reader, `parity compare`, `parity report`
and `parity check --golden` take as it is; a golden made before (the files directly in the
folder) is read as one baseline.

A run is judged against the baseline of its own environment: a mismatch there is a regression.
With none for its environment it is compared with the closest one (fewest fingerprint keys
apart): equal bits still match, a mismatch says "environment changed: rebaseline" and names what
differs; `save_golden` (`pytest -m parity --parity-update-golden`) then adds this environment's
baseline and leaves the others as they are. A key a baseline does not record (it was made before
the key was fingerprinted) tells no environments apart.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from parity.files import write_json_atomic
from parity.judge.compare import Comparison, compare_frames, default_policy, printable
from parity.readers import MetricsError, read_metrics, read_summary, skipped_count, write_metrics
from parity.record.runfolder import manifest_path, metrics_path

FINGERPRINT_KEYS = (
    "environment.python",
    "environment.torch",
    "environment.transformers",
    "environment.machine",
    "environment.cpu_isa",
    "environment.cpu_vendor",
    "environment.cuda",
    "environment.gpu",
    "backend",
    "device",
    "world_size",
    "determinism.num_threads",
)

MATCH, REGRESSION, ENV_CHANGED = "match", "regression", "environment changed: rebaseline"


class GoldenError(MetricsError):
    """A golden that cannot be compared at all (missing, wrong length, unknown metrics)."""


_UNRECORDED = object()


def _lookup(manifest: dict[str, Any], key: str) -> Any:
    """The value at a dotted key (null included), or _UNRECORDED where the manifest lacks it."""
    node: Any = manifest
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return _UNRECORDED
        node = node[part]
    return node


def fingerprint(manifest: dict[str, Any]) -> dict[str, Any]:
    """The environment facts of a run manifest that decide whether bits can be reproduced."""
    values = {key: _lookup(manifest, key) for key in FINGERPRINT_KEYS}
    return {key: None if v is _UNRECORDED else v for key, v in values.items()}


def environment_diff(stored: dict[str, Any], current: dict[str, Any]) -> dict[str, tuple]:
    """The fingerprint keys in which a baseline's manifest and a run's differ, as (baseline, run);
    a key the baseline does not record tells nothing apart."""
    a, b = fingerprint(stored), fingerprint(current)
    recorded = [k for k in FINGERPRINT_KEYS if _lookup(stored, k) is not _UNRECORDED]
    return {k: (a[k], b[k]) for k in recorded if a[k] != b[k]}


def _compared(frame: pd.DataFrame) -> pd.DataFrame:
    """Drop metrics whose default policy ignores them (timing): they never belong in a golden."""
    keep = [c for c in frame.columns if default_policy(c).kind != "ignore"]
    out = frame[keep]
    out.attrs = {k: v for k, v in frame.attrs.items() if k != "present"}
    return out


MAX_MANIFEST_DEPTH = 64  # a manifest nests a few levels (config.model.x); deeper is damage


def _depth(obj: Any) -> int:
    """How deeply lists and objects nest in parsed JSON (iterative: no recursion to exhaust)."""
    deepest, stack = 0, [(obj, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, (dict, list)):
            deepest = max(deepest, depth)
            items = node.values() if isinstance(node, dict) else node
            if depth <= MAX_MANIFEST_DEPTH:
                stack += [(x, depth + 1) for x in items]
    return deepest


def read_manifest(path: str | Path) -> dict[str, Any]:
    """A manifest.json as a dict, or a one-line GoldenError naming the file: missing, not JSON,
    nested deeper than MAX_MANIFEST_DEPTH, or not a JSON object."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise GoldenError(f"{path}: missing (the environment fingerprint is needed)") from None
    except RecursionError:
        raise GoldenError(f"{path}: cannot read: JSON nested too deeply") from None
    except (OSError, ValueError) as e:  # not UTF-8, not JSON, an integer of 5000 digits
        raise GoldenError(f"{path}: cannot read: {str(e).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise GoldenError(f"{path}: must be a JSON object, got {type(data).__name__}")
    if _depth(data) > MAX_MANIFEST_DEPTH:
        raise GoldenError(f"{path}: cannot read: nested deeper than {MAX_MANIFEST_DEPTH} levels")
    return data


def _manifest(folder: Path) -> dict[str, Any]:
    """A run's or golden's manifest.json, or a one-line GoldenError naming the file."""
    return read_manifest(manifest_path(folder))


def baseline_name(env: dict[str, Any]) -> str:
    """The folder of one environment's baseline, readable at a glance: device, then the GPU or
    the machine and its CPU instruction sets, then a hash of the whole fingerprint."""
    digest = hashlib.blake2b(
        json.dumps(env, sort_keys=True, default=str).encode(), digest_size=4
    ).hexdigest()
    gpu, isa = env.get("environment.gpu"), env.get("environment.cpu_isa") or []
    parts = [env.get("device") or "unknown"]
    parts += [str(gpu)] if gpu else [env.get("environment.machine") or "unknown", *isa]
    label = f"{parts[0]}-{'.'.join(parts[1:])}-{digest}"
    return re.sub(r"[^A-Za-z0-9_.-]", "_", label)


def baselines(golden_dir: Path) -> list[Path]:
    """Every baseline of a golden: the folder itself (the older one-baseline layout), then each
    subfolder holding a metrics.jsonl, by name."""
    golden_dir = Path(golden_dir)
    found = [golden_dir] if metrics_path(golden_dir).is_file() else []
    if golden_dir.is_dir():
        found += sorted(p for p in golden_dir.iterdir() if metrics_path(p).is_file())
    return found


def _closest(golden_dir: Path, run_dir: Path) -> tuple[Path, dict[str, tuple]] | None:
    """The golden's baseline fewest fingerprint keys apart from the run (the first of those),
    with the keys apart; None when the golden has no baseline."""
    found = baselines(golden_dir)
    if not found:
        return None
    run = _manifest(run_dir)
    diffs = [environment_diff(_manifest(b), run) for b in found]
    best = min(range(len(found)), key=lambda i: len(diffs[i]))
    return found[best], diffs[best]


def baseline_for(golden_dir: Path, run_dir: Path) -> Path | None:
    """The baseline recorded in the run's own environment, or None."""
    closest = _closest(golden_dir, run_dir)
    return closest[0] if closest is not None and not closest[1] else None


def save_golden(golden_dir: Path, run_dir: Path, spec: dict | None = None) -> Path:
    """Make (or rewrite) the baseline of the run's environment in a golden; the baselines of
    other environments are kept. Returns the baseline's folder. A run that did not finish (no
    end record) or whose read skipped records is refused (MetricsError) before anything is
    written: the baseline it would replace is kept."""
    golden_dir = Path(golden_dir)
    read = read_metrics(run_dir)
    if read.attrs.get("complete") is False or skipped_count(read):
        why = read.attrs.get("incomplete") or "no end record" if not skipped_count(read) else (
            read_summary(read))  # fmt: skip
        raise MetricsError(f"{run_dir}: not made into a golden: the run is not whole ({why})")
    frame = _compared(read)
    env = fingerprint(_manifest(run_dir))
    target = baseline_for(golden_dir, run_dir) or golden_dir / baseline_name(env)
    target.mkdir(parents=True, exist_ok=True)
    write_metrics(frame, metrics_path(target), "jsonl")
    write_json_atomic(manifest_path(target), {"golden": {"spec": spec or {}}, **_nest(env)})
    return target


def _nest(flat: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in flat.items():
        node = out
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out


@dataclass
class GoldenResult:
    status: str  # MATCH, REGRESSION or ENV_CHANGED
    comparison: Comparison
    environment_diff: dict[str, tuple[Any, Any]] = field(default_factory=dict)
    baseline: Path | None = None  # the baseline the run was compared with
    own_environment: bool = True  # whether that baseline was recorded in the run's environment
    new_metrics: list[str] = field(default_factory=list)  # in the run, not yet in the golden

    @property
    def ok(self) -> bool:
        return self.status == MATCH

    def message(self) -> str:
        if self.baseline is None:
            where = ""
        elif self.own_environment:
            where = f" (baseline {self.baseline.name}, this environment's)"
        else:
            where = (
                f" (baseline {self.baseline.name}; none recorded in this environment, "
                "this is the closest)"
            )
        lines = [f"golden: {self.status}{where}"]
        for key, (g, r) in self.environment_diff.items():
            lines.append(f"  {key}: golden {g!r}, run {r!r}")
        if self.new_metrics:
            lines.append(
                f"  not judged: {len(self.new_metrics)} metrics newer than the golden "
                f"({', '.join(map(printable, self.new_metrics))}); rebaseline to pin them"
            )
        return "\n".join(lines + [self.comparison.table()])


def verify_golden(golden_dir: Path, run_dir: Path, policies=None) -> GoldenResult:
    """Compare a finished run with the golden's baseline for its environment (else the closest);
    GoldenError when they cannot be compared."""
    golden_dir = Path(golden_dir)
    closest = _closest(golden_dir, run_dir)
    if closest is None:
        raise GoldenError(
            f"{golden_dir}: no golden here; make it with `pytest -m parity --parity-update-golden`"
        )
    baseline, diff = closest
    golden = _compared(read_metrics(baseline))
    run = _compared(read_metrics(run_dir))
    if len(golden.index) != len(run.index) or list(golden.index) != list(run.index):
        raise GoldenError(
            f"{metrics_path(baseline)}: golden has {len(golden.index)} steps "
            f"({golden.index.min()}..{golden.index.max()}), the run has {len(run.index)} "
            f"({run.index.min()}..{run.index.max()})"
        )
    dropped = sorted(set(golden.columns) - set(run.columns))
    if dropped:
        raise GoldenError(
            f"{metrics_path(baseline)}: metrics of the golden the run no longer logs: "
            + ", ".join(map(printable, dropped))
        )
    # a metric added since the golden was recorded cannot have regressed: listed, not judged
    # (a golden of another host cannot be re-recorded here; see GoldenResult.message)
    new = sorted(set(run.columns) - set(golden.columns))
    comparison = compare_frames(golden, run[list(golden.columns)], policies)
    if comparison.ok:
        status = MATCH
    else:
        status = ENV_CHANGED if diff else REGRESSION
    own = not diff
    return GoldenResult(status, comparison, diff, baseline, own_environment=own, new_metrics=new)
