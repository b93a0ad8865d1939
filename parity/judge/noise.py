"""Noise floor: run side A twice before judging B, so a nondeterministic setup is not blamed on B.

If A against its own repeat A' is not bitwise identical, no exact comparison of A with B means
anything: the verdict is "nondeterministic" (exit 4) and the floor per metric (the largest
abs / rel / ULP difference of A vs A') says how big the run-to-run noise is. If A and A' agree
bit for bit, the floor is zero and the pair is judged as usual.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from parity.judge.compare import (
    Comparison,
    Policy,
    compare_frames,
    json_value,
    printable,
    resolve_policy,
)
from parity.judge.policy import Policies, parse_policies

__all__ = ["NONDETERMINISTIC", "NoiseFloor", "floor_from_frames", "floor_policies"]

NONDETERMINISTIC = "nondeterministic"


def floor_policies(metrics: Iterable[str], policies: Policies | None = None) -> dict[str, Policy]:
    """Exact for every metric the pair judges; metrics the pair ignores are ignored here too.

    Why exact and not the pair's policy: the floor asks whether the environment reproduces at
    all; a tolerance would hide exactly the noise it is meant to measure.
    """
    policies = policies or {}
    ignored = {name for name in metrics if resolve_policy(name, policies).kind == "ignore"}
    return {name: Policy("ignore" if name in ignored else "exact") for name in metrics}


@dataclass
class NoiseFloor:
    """A against its repeat A' (both run from the same spec): the environment's own noise."""

    comparison: Comparison
    a_dir: Path | None = None
    repeat_dir: Path | None = None
    runs: tuple[Any, Any] | None = None  # (A, A') as parity.run.job.Run, when launched here

    @property
    def deterministic(self) -> bool:
        return self.comparison.ok

    def metrics(self) -> dict[str, dict[str, Any]]:
        """Per judged metric: max abs / rel / ULP difference of A vs A' and the first step."""
        out = {}
        for name, m in sorted(self.comparison.metrics.items()):
            if m.status == "ignored":
                continue
            out[name] = {
                "max_abs_diff": m.max_abs_diff or 0.0,
                "max_rel_diff": m.max_rel_diff or 0.0,
                "max_ulp": m.max_ulp or 0,
                "first_step": m.first_divergent_step,
                "status": m.status,
            }
        return out

    def noisy(self) -> list[str]:
        """Names of the metrics that differ between A and A'."""
        return [m.name for m in self.comparison.failures]

    def headline(self) -> str:
        if self.deterministic:
            return "noise floor: zero (side A run twice is bitwise identical)"
        noisy = self.noisy()
        shown = ", ".join(map(printable, noisy[:4])) + (", ..." if len(noisy) > 4 else "")
        return (
            f"environment is not deterministic: side A run twice differs in {len(noisy)} "
            f"metric(s) ({shown}); "
            "B was not judged"
        )

    def table(self) -> str:
        """The floor per noisy metric (all metrics when there is no noise); names printable()."""
        rows = [("metric", "max_abs", "max_rel", "max_ulp", "first_step")]
        for name, f in self.metrics().items():
            if self.deterministic or f["status"] != "match":
                first = "-" if f["first_step"] is None else str(f["first_step"])
                cells = (f["max_abs_diff"], f["max_rel_diff"], f["max_ulp"])
                rows.append((printable(name), *(repr(v) for v in cells), first))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = [self.headline()]
        for r in rows:
            lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
        if not self.deterministic:
            lines.append(
                "fix the source of nondeterminism, or judge with a tolerance at least this floor "
                "(e.g. --policy METRIC=ulp:K)"
            )
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able: deterministic, the floor per metric, and where A and A' ran."""
        floor = {n: {k: json_value(v) for k, v in f.items()} for n, f in self.metrics().items()}
        return {
            "deterministic": self.deterministic,
            "floor_is_zero": self.deterministic,
            "a": str(self.a_dir) if self.a_dir else None,
            "a_repeat": str(self.repeat_dir) if self.repeat_dir else None,
            "metrics": floor,
        }


def floor_from_frames(
    a: pd.DataFrame,
    repeat: pd.DataFrame,
    policies: Mapping[str, Policy | str] | None = None,
    **compare_kwargs: Any,
) -> NoiseFloor:
    """The floor of two already-read runs of the same side (policies: the pair's)."""
    names = set(map(str, a.columns)) | set(map(str, repeat.columns))
    floor = floor_policies(names, parse_policies(policies))
    comparison = compare_frames(a, repeat, floor, **compare_kwargs)
    return NoiseFloor(comparison)
