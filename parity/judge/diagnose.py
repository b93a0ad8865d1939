"""Diagnosis beyond the verdict: *why* two runs part, and which rank breaks ranks within one run.

It reads only the files a job writes next to metrics.jsonl through the recorder
(``parity.record``: our jobs' JobLog, any training loop, HF's Trainer through its callback):

- ``ranks/rank{r}.jsonl``: every rank's own post-reduction metrics (metrics.jsonl format) and,
  in ``_meta.data``, a digest of the micro-batches it trained on (``train``) and evaluated
  (``val``) that step. Equal digests in A and B mean the same token ids, labels, positions and
  loss masks in the same micro-batches, so a divergence is either "batches differ from step k"
  (data order, sampler, packing) or "same batches, numbers differ from step k" (numerics).
  PPO jobs also digest each step's ``prompts`` and the ``rollout`` (the scoring forwards over
  prompt + response): prompts that differ are the data order; the same prompts with other
  rollouts are "rollouts differ" (generation); the same rollouts cut into other batches are
  the mini-batch shuffle or packing.
- ``ops/rank{r}.jsonl``: every op of one traced step (the recorder's ``trace_ops``):
  the first op whose output differs, its ULP distance and whether its inputs were equal, and
  the ops only one side runs (``parity.judge.opdiff``).
- ``fingerprints.jsonl``: rank 0's hash of every full parameter (before the step's update) and
  pre-clip gradient at the recorder's ``fingerprint_steps``: the first step and the tensors
  that differ point at a layer.

Rank agreement: metrics reduced over ranks (loss, lr, grad_norm, token counts) must be bitwise
equal on every rank; a rank whose own record disagrees with rank 0's is named. A run without
these files (another trainer's log) is "unavailable", never an error; a malformed file is a
one-line error naming the file and line, kept in ``errors`` so the verdict still stands.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from parity.judge.compare import Comparison, compare_frames, json_value, printable
from parity.judge.opdiff import OpDiff, compare_ops
from parity.readers import MetricsError, read_metrics
from parity.readers.frame import steps_text
from parity.readers.runfolder import (
    DiagnosisError,
    rank_files,
    read_fingerprints,
    read_rank_data,
    run_folder,
)
from parity.record.runfolder import FINGERPRINTS, RANKS_DIR, fingerprints_path, rank_file_name

__all__ = [
    "DataDiff",
    "Diagnosis",
    "DiagnosisError",
    "FingerprintDiff",
    "RankAgreement",
    "RankDisagreement",
    "diagnose",
    "rank_agreement",
    "read_fingerprints",
    "read_rank_data",
    "run_folder",
]

KINDS = ("prompts", "rollout", "train", "val")  # digest kinds, in the order a step runs them
_WHAT = {"prompts": "prompts", "rollout": "rollouts", "train": "batches", "val": "val batches"}
MAX_NAMES = 3  # tensor names quoted in one line


# --- results ------------------------------------------------------------------------------------


def _ranks(ranks: Iterable[int]) -> str:
    ranks = list(ranks)
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


@dataclass
class DataDiff:
    """Where A's and B's digests of one kind (KINDS: "train", "val", PPO's "prompts" and
    "rollout") first differ."""

    kind: str
    status: Literal["same", "differ", "unavailable"] = "unavailable"
    steps_compared: int = 0
    first_step: int | None = None
    ranks: list[int] = field(default_factory=list)
    detail: str = ""  # counts at the first differing step, or why it is unavailable

    def line(self) -> str:
        what = _WHAT.get(self.kind, f"{self.kind} batches")
        if self.status == "differ":
            return (
                f"{what} differ from step {self.first_step} ({_ranks(self.ranks)}): {self.detail}"
            )
        if self.status == "same":
            return f"{what} identical at all {self.steps_compared} steps compared"
        return f"{what}: {self.detail}" if self.detail else ""


@dataclass
class FingerprintDiff:
    """First fingerprinted step where weights or gradients differ, and which tensors."""

    status: Literal["same", "differ", "unavailable"] = "unavailable"
    steps_compared: list[int] = field(default_factory=list)
    first_weight_step: int | None = None
    weight_tensors: list[str] = field(default_factory=list)
    first_grad_step: int | None = None
    grad_tensors: list[str] = field(default_factory=list)
    total_tensors: int = 0
    detail: str = ""

    @property
    def root(self) -> tuple[str, int, list[str]] | None:
        """The earliest difference: weights at step k come before gradients at step k."""
        events = []
        if self.first_weight_step is not None:
            events.append((self.first_weight_step, 0, "weights", self.weight_tensors))
        if self.first_grad_step is not None:
            events.append((self.first_grad_step, 1, "gradients", self.grad_tensors))
        if not events:
            return None
        step, _, what, names = min(events, key=lambda e: (e[0], e[1]))
        return what, step, names

    def line(self) -> str:
        steps = steps_text(self.steps_compared)
        if self.status == "unavailable":
            return f"fingerprints: {self.detail}" if self.detail else ""
        if self.status == "same":
            return f"weights and gradients identical at fingerprinted steps {steps}"
        what, step, names = self.root  # type: ignore[misc]
        if len(names) >= self.total_tensors:
            text = f"{what} first differ at step {step} in all {len(names)} tensors"
        else:
            prefix = _common_prefix(names)
            under = f" under {prefix}" if prefix else ""
            shown = ", ".join(names[:MAX_NAMES]) + (", ..." if len(names) > MAX_NAMES else "")
            text = (
                f"{what} first differ at step {step} in {len(names)} of {self.total_tensors} "
                f"tensors{under}: {shown}"
            )
        other = (
            ("weights", self.first_weight_step)
            if what == "gradients"
            else ("gradients", self.first_grad_step)
        )
        if other[1] is not None:
            text += f"; {other[0]} from step {other[1]}"
        return text + f" (fingerprinted steps {steps})"


def _common_prefix(names: list[str]) -> str:
    """The longest dotted module path every name starts with ("" if none or only one name)."""
    if len(names) < 2:
        return ""
    parts = [n.split(".")[:-1] for n in names]
    common = []
    for group in zip(*parts, strict=False):
        if len(set(group)) != 1:
            break
        common.append(group[0])
    return ".".join(common)


@dataclass
class RankDisagreement:
    """A rank whose post-reduction value of a metric is not rank 0's, first at `step`."""

    rank: int
    metric: str
    step: int
    value: float | None
    rank0_value: float | None

    def line(self, side: str = "") -> str:
        where = f"{side}: " if side else ""
        return (
            f"{where}rank {self.rank} disagrees with rank 0 on {self.metric} from step "
            f"{self.step} ({self.value!r} vs {self.rank0_value!r})"
        )


@dataclass
class RankAgreement:
    """Whether every rank of one run recorded rank 0's reduced metrics, bit for bit."""

    run_dir: str
    status: Literal["agree", "disagree", "unavailable"] = "unavailable"
    ranks: int = 0
    disagreements: list[RankDisagreement] = field(default_factory=list)
    comparisons: dict[int, Comparison] = field(default_factory=dict)  # rank -> vs rank 0
    detail: str = ""

    def to_dict(self) -> dict[str, Any]:
        return json_value(
            {
                "run_dir": self.run_dir,
                "status": self.status,
                "ranks": self.ranks,
                "disagreements": [vars(d).copy() for d in self.disagreements],
                "detail": self.detail,
            }
        )


def rank_agreement(run_dir: str | os.PathLike[str]) -> RankAgreement:
    """Compare every rank's own metrics record with rank 0's (exact; timing metrics ignored).

    Raises DiagnosisError (or MetricsError) naming the file and line of a malformed rank file.
    """
    run_dir = Path(run_dir)
    files = rank_files(run_dir)
    result = RankAgreement(str(run_dir), ranks=len(files))
    if 0 not in files:
        result.detail = f"no {RANKS_DIR}/{rank_file_name(0)} in {run_dir}"
        return result
    base = read_metrics(files[0], "jsonl")
    for rank, path in files.items():
        if rank == 0:
            continue
        comparison = compare_frames(
            base, read_metrics(path, "jsonl"), allow_incomplete=True, allow_missing=True,
            allow_nothing_compared=True,  # ranks with no metric of their own: digests only
        )  # fmt: skip
        result.comparisons[rank] = comparison
        m = comparison.first_divergence()
        if m is not None:
            step = m.first_divergent_step
            assert step is not None
            result.disagreements.append(RankDisagreement(rank, m.name, step, m.b_value, m.a_value))
    result.status = "disagree" if result.disagreements else "agree"
    return result


# --- A against B --------------------------------------------------------------------------------


def _counts(d: dict | None) -> str:
    if not d:
        return "nothing"
    if "prompts" in d:
        return f"{d.get('prompts')} prompts, {d.get('tokens')} tokens"
    return f"{d.get('micro_batches')} micro-batches, {d.get('tokens')} tokens"


def compare_data(
    a: dict[int, dict[int, dict]], b: dict[int, dict[int, dict]], kind: str
) -> DataDiff:
    """First step where any rank's `kind` digest differs between A and B (same world size only)."""
    out = DataDiff(kind)
    if not a or not b:
        out.detail = f"no {RANKS_DIR}/ digests in {'a' if not a else 'b'}"
        return out
    if set(a) != set(b):
        out.detail = (
            f"world sizes differ ({len(a)} vs {len(b)} ranks): per-rank batches not comparable"
        )
        return out
    steps = sorted(set.intersection(*(set(s) for s in [*a.values(), *b.values()])))
    compared = 0
    for step in steps:
        entries = {r: (a[r][step].get(kind), b[r][step].get(kind)) for r in sorted(a)}
        if all(x is None and y is None for x, y in entries.values()):
            continue  # no such batches this step on either side (e.g. no val)
        compared += 1
        differ = [
            r for r, (x, y) in entries.items() if (x or {}).get("hash") != (y or {}).get("hash")
        ]
        if differ:
            r = differ[0]
            x, y = entries[r]
            out.status, out.first_step, out.ranks = "differ", step, differ
            out.steps_compared = compared
            verb = "got" if kind == "prompts" else "ran"
            out.detail = f"rank {r} {verb} {_counts(x)} in a, {_counts(y)} in b"
            return out
    out.status, out.steps_compared = ("same", compared) if compared else ("unavailable", 0)
    if not compared:
        out.detail = f"no {kind} digests recorded"
    return out


def compare_fingerprints(a_dir: Path | None, b_dir: Path | None) -> FingerprintDiff:
    """First fingerprinted step where A's and B's weights, then gradients, differ."""
    out = FingerprintDiff()
    have = [d is not None and fingerprints_path(d).is_file() for d in (a_dir, b_dir)]
    if not any(have):
        return out
    if not all(have):
        side = "b" if have[0] else "a"
        out.detail = (
            f"no {FINGERPRINTS} in {side} (the recorder writes it: record_run(out, "
            'fingerprint_steps="1,5") and rec.fingerprint(step, model) after backward)'
        )
        return out
    assert a_dir is not None and b_dir is not None
    fa, fb = (read_fingerprints(fingerprints_path(d)) for d in (a_dir, b_dir))
    out.steps_compared = sorted(set(fa) & set(fb))
    if not out.steps_compared:
        out.detail = "no step fingerprinted on both sides"
        return out
    for step in out.steps_compared:
        for key, first, names in (
            ("params", "first_weight_step", "weight_tensors"),
            ("grads", "first_grad_step", "grad_tensors"),
        ):
            ta, tb = fa[step][key], fb[step][key]
            order = list(ta) + [n for n in tb if n not in ta]
            out.total_tensors = max(out.total_tensors, len(order))
            differ = [n for n in order if ta.get(n, "absent") != tb.get(n, "absent")]
            if differ and getattr(out, first) is None:
                setattr(out, first, step)
                setattr(out, names, differ)
    out.status = "differ" if out.root is not None else "same"
    return out


@dataclass
class Diagnosis:
    """What kind of divergence A vs B is, where it starts, and whether each run's ranks agree."""

    verdict: str
    kind: Literal[
        "batches differ", "rollouts differ", "same batches, numbers differ", "aligned", "unknown"
    ]
    step: int | None = None
    metric: str | None = None
    train: DataDiff = field(default_factory=lambda: DataDiff("train"))
    val: DataDiff = field(default_factory=lambda: DataDiff("val"))
    prompts: DataDiff = field(default_factory=lambda: DataDiff("prompts"))  # PPO only
    rollout: DataDiff = field(default_factory=lambda: DataDiff("rollout"))  # PPO only
    fingerprints: FingerprintDiff = field(default_factory=FingerprintDiff)
    ops: OpDiff = field(default_factory=OpDiff)  # both runs traced one step (trace_ops)
    ranks: dict[str, RankAgreement] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)

    def data(self) -> dict[str, DataDiff]:
        """Every digest kind's comparison, in KINDS order."""
        return {kind: getattr(self, kind) for kind in KINDS}

    def _same_until(self, kind: str) -> bool:
        """Whether `kind` was compared and is the same at least up to this step."""
        d = getattr(self, kind)
        return d.status == "same" or (d.first_step is not None and d.first_step > self.step)

    def headline(self) -> str:
        """One line for a diverged verdict ("" when nothing was recorded to tell from)."""
        if self.kind in ("batches differ", "rollouts differ"):
            d = next(d for d in self.data().values() if d.first_step == self.step)
            where = f"{_WHAT[d.kind]} differ from step {self.step} ({_ranks(d.ranks)})"
            if d.kind == "prompts":
                why = "data order or sampler, not numerics"
            elif d.kind == "rollout":
                why = (
                    "the same prompts got other responses: generation (sampling or the rollout "
                    "code), not the data order"
                    if self._same_until("prompts")
                    else "generation or the prompts"
                )
            elif self._same_until("prompts") and self._same_until("rollout"):
                why = (
                    "the same rollouts cut into other batches (mini-batch shuffle or packing), "
                    "not numerics"
                )
            else:
                why = "data order, sampler or packing, not numerics"
            return f"{where}: {why}; {d.detail}"
        if self.kind == "same batches, numbers differ":
            return f"same batches, numbers differ from step {self.step} ({self.metric})"
        if self.kind == "unknown" and self.metric is not None and self.train.detail:
            return f"numbers differ from step {self.step} ({self.metric}); {self.train.line()}"
        return ""

    def lines(self) -> list[str]:
        """Every finding worth a line: the headline (diverged only), fingerprints, rank
        disagreements (always: a job whose ranks disagree is broken whatever B says), errors.

        Names in them (metrics, tensors, modules, ops) come from the files: printable()."""
        return [printable(line) for line in self._lines()]

    def _lines(self) -> list[str]:
        out = []
        if self.verdict != "aligned" and self.headline():
            out.append(self.headline())
        if self.kind == "same batches, numbers differ" and self.train.first_step is not None:
            out.append(self.train.line())
        if self.verdict != "aligned" and self.fingerprints.line():
            out.append(self.fingerprints.line())
        if self.ops.line() and (self.verdict != "aligned" or self.ops.status != "same"):
            out.append(self.ops.line())
            if self.ops.cost_line():
                out.append(self.ops.cost_line())
        for side, agreement in self.ranks.items():
            out += [d.line(side) for d in agreement.disagreements]
        return out + self.errors

    def to_dict(self) -> dict[str, Any]:
        """JSON-able (json.dumps(..., allow_nan=False))."""
        return json_value(
            {
                "kind": self.kind,
                "step": self.step,
                "metric": self.metric,
                "headline": self.headline(),
                "lines": self.lines(),
                "data": {kind: vars(d).copy() for kind, d in self.data().items()},
                "fingerprints": {**vars(self.fingerprints), "root": self.fingerprints.root},
                "ops": self.ops.to_dict(),
                "ranks": {side: r.to_dict() for side, r in self.ranks.items()},
                "errors": list(self.errors),
            }
        )


def _first_metric(comparison: Comparison | None) -> tuple[int | None, str | None]:
    if comparison is None:
        return None, None
    m = comparison.first_divergence()
    return (None, None) if m is None else (m.first_divergent_step, m.name)


# What a damaged diagnosis file raises (a JSON nested too deep, a file that is no UTF-8, a folder
# that cannot be listed): its one-line message becomes an error of the diagnosis.
_DAMAGED = (MetricsError, OSError, RecursionError, UnicodeError, ValueError)


def _safely(out: Diagnosis, read: Any, *args: Any, default: Any = None) -> Any:
    """read(*args), or `default` with the error's line in out.errors when a file is damaged."""
    try:
        return read(*args)
    except _DAMAGED as e:
        text = str(e).strip()
        out.errors.append(printable(text.splitlines()[0]) if text else type(e).__name__)
        return default


def diagnose(
    a: str | os.PathLike[str] | None,
    b: str | os.PathLike[str] | None,
    comparison: Comparison | None = None,
) -> Diagnosis:
    """Diagnose A vs B (run folders or metrics files in them) given their metric comparison.

    Never raises for a bad diagnosis file: its one-line error lands in Diagnosis.errors.
    """
    dirs = {side: run_folder(p) if p is not None else None for side, p in (("a", a), ("b", b))}
    step, metric = _first_metric(comparison)
    verdict = comparison.verdict if comparison is not None else "unknown"
    out = Diagnosis(verdict, "unknown", step, metric)
    data = {}
    for side, d in dirs.items():
        data[side] = _safely(out, read_rank_data, d, default={}) if d is not None else {}
        if d is not None and data[side]:
            agreement = _safely(out, rank_agreement, d)
            if agreement is not None:
                out.ranks[side] = agreement
    if data["a"] or data["b"]:
        for kind in KINDS:
            setattr(out, kind, compare_data(data["a"], data["b"], kind))
    out.fingerprints = _safely(
        out, compare_fingerprints, dirs["a"], dirs["b"], default=FingerprintDiff()
    )
    out.ops = _safely(out, compare_ops, dirs["a"], dirs["b"], default=OpDiff())
    out.errors += map(printable, out.ops.errors)  # a values file not read: the op is named
    # the earliest data difference at or before the first metric divergence explains it; at one
    # step, the earliest in the step's own order (prompts, rollout, train, val)
    candidates = [
        (d.first_step, i, d.kind)
        for i, d in enumerate(out.data().values())
        if d.first_step is not None and (step is None or d.first_step <= step)
    ]
    if candidates:
        out.step, _, root = min(candidates)
        out.kind = "rollouts differ" if root == "rollout" else "batches differ"
        return out
    if step is None:
        out.kind = "aligned" if verdict == "aligned" else "unknown"
        return out
    later = out.train.status == "differ"  # only after `step`: earlier ones returned above
    recorded = out.train.status == "same" or later or (step == 0 and out.val.status == "same")
    out.kind = "same batches, numbers differ" if recorded else "unknown"
    return out
