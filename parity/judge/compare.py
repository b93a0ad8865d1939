"""Compare two canonical metric frames metric by metric under their policies (parity.judge.
policy), in ULPs (parity.judge.ulp): each metric's verdict and first divergent step, the table,
and the JSON a script reads. Policy and ulp_distance are re-exported here for callers.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import ItemsView, Iterator, Mapping, ValuesView
from dataclasses import dataclass, field, fields
from typing import Any, Literal

import numpy as np
import pandas as pd

from parity.errors import PolicyError
from parity.judge.policy import (
    JUDGED_COUNTERS,
    NOISE_PATTERNS,
    Policy,
    StepRange,
    default_policy,
    parse_policies,
    piece_index,
    resolve_all,
    resolve_policy,
)
from parity.judge.ulp import ULP_MAX, ulp_distance
from parity.readers import (
    IncompleteRunError,
    MetricsError,
    SkippedRecordsError,
    read_metrics,
    read_summary,
    skipped_count,
)
from parity.readers.frame import FLOAT64, coarser
from parity.readers.labels import align_step_labels

__all__ = [
    "JUDGED_COUNTERS",
    "NOISE_PATTERNS",
    "ULP_MAX",
    "Comparison",
    "IncompleteRunError",
    "MetricResult",
    "MetricResults",
    "MetricsError",
    "NothingComparedError",
    "Policy",
    "PolicyError",
    "SkippedRecordsError",
    "StepRange",
    "compare_frames",
    "default_policy",
    "resolve_policy",
    "printable",
    "ulp_distance",
]

_ORDER = {"diverged": 0, "missing": 1, "imprecise": 2, "match": 3, "ignored": 4}
ADVICE = (
    "log the full float, or judge at the source precision with --at-source-precision or a "
    "close:/ulp: policy"
)


class NothingComparedError(MetricsError):
    """Two sides with no metric judged at any step (every one ignored, or none on both sides):
    no verdict, since "aligned" would say nothing was found that nothing was looked for."""


@dataclass
class MetricResult:
    """One metric's verdict and where it first went wrong."""

    name: str
    policy: str
    status: Literal["match", "diverged", "ignored", "missing", "imprecise"]
    ok: bool = True
    steps_compared: int = 0
    exact_matches: int = 0
    divergent_steps: int = 0
    first_divergent_step: int | None = None
    first_divergent_policy: str | None = None  # the policy (piece) in force at that step
    a_value: float | None = None
    b_value: float | None = None
    max_abs_diff: float | None = None
    max_abs_diff_step: int | None = None
    max_rel_diff: float | None = None
    max_rel_diff_step: int | None = None
    max_ulp: int | None = None
    max_ulp_step: int | None = None
    missing_in_a: list[int] = field(default_factory=list)
    missing_in_b: list[int] = field(default_factory=list)
    precision: str = FLOAT64  # what both sources hold: the values are judged at it
    ulp_dtype: str = FLOAT64  # the float type max_ulp and ulp: policies count in
    note: str = ""


_RESULT_FIELDS = tuple(f.name for f in fields(MetricResult) if f.name != "name")
_IGNORED, _MATCH = _ORDER["ignored"], _ORDER["match"]
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u200e\u200f\u202a-\u202e\u2066-\u2069]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(m: re.Match) -> str:
    c = m.group()
    if c in _NAMED:
        return _NAMED[c]
    return f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}"


def printable(text: str) -> str:
    """``text`` (a metric name, a note, a path: data from a log) for one line of a terminal:
    control characters (C0, DEL, C1), line and paragraph separators and bidi controls shown
    escaped (``\\n``, ``\\r``, ``\\t``, ``\\x1b``, ``\\u202e``), so a name cannot end its row,
    print a line of its own ("verdict: aligned"), move the cursor or erase what was printed."""
    text = str(text)
    return text if _CONTROL.search(text) is None else _CONTROL.sub(_escape, text)


def json_value(v: Any) -> Any:
    """``v`` as strict JSON takes it: numpy scalars as Python ones, a non-finite float as its
    repr ('nan', 'inf'), through lists and dicts."""
    if isinstance(v, (float, np.floating)):
        return float(v) if math.isfinite(v) else repr(float(v))
    if isinstance(v, np.integer):
        return int(v)
    if isinstance(v, dict):
        return {k: json_value(x) for k, x in v.items()}
    if isinstance(v, list):
        return [json_value(x) for x in v]
    return v


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, int) and v == ULP_MAX:
        return "max"
    return repr(v)


class MetricResults(Mapping[str, MetricResult]):
    """Every metric's MetricResult by name, read-only (compare_frames': in name order).

    A metric equal bit for bit at every step, with no step missing on either side, is kept as
    its policy, step count and first step, and an ignored one as its policy, until it is read:
    their results follow from those alone, so a comparison of 400,000 metrics costs arrays, not
    400,000 objects. ``failures``, ``counts``, ``ordered`` and ``judged_at`` read the arrays.
    """

    def __init__(
        self,
        names: list[str],
        built: list[MetricResult | None],
        status: np.ndarray,
        ok: np.ndarray,
        precision: tuple[np.ndarray, list[str]],
        lazy: tuple[np.ndarray, list[str], np.ndarray, np.ndarray] | None = None,
        rank: np.ndarray | None = None,
    ) -> None:
        """built[j]: name j's result, or None where ``lazy`` (policy index, policy texts, steps
        compared, first step compared) makes it on first read; status: _ORDER codes; precision:
        (index per name, texts); rank: each name's place in name order (None: names sorted)."""
        self._names, self._built, self._status, self._ok = names, built, status, ok
        self._precision, self._lazy = precision, lazy
        self._rank = np.arange(len(names)) if rank is None else rank
        self._index: dict[str, int] | None = None

    @classmethod
    def of(cls, results: Mapping[str, MetricResult]) -> MetricResults:
        """Results already made (a dict name -> MetricResult), in its order."""
        names, built = list(results), list(results.values())
        texts = sorted({r.precision for r in built})
        code = {p: i for i, p in enumerate(texts)}
        order = sorted(range(len(names)), key=names.__getitem__)
        rank = np.empty(len(names), dtype=np.int64)
        rank[order] = np.arange(len(names))
        return cls(
            names,
            list(built),
            np.array([_ORDER[r.status] for r in built], dtype=np.int8),
            np.array([r.ok for r in built], dtype=bool),
            (np.array([code[r.precision] for r in built], dtype=np.int64), texts),
            rank=rank,
        )

    def _at(self, j: int) -> MetricResult:
        found = self._built[j]
        if found is None:
            found = self._built[j] = self._make(j)
        return found

    def _make(self, j: int) -> MetricResult:
        assert self._lazy is not None
        which, texts, count, first = self._lazy
        name, policy = self._names[j], texts[which[j]]
        precision = self._precision[1][self._precision[0][j]]
        if self._status[j] == _IGNORED:
            return MetricResult(name, policy, "ignored", precision=precision)
        n = int(count[j])
        step, zero, none = (int(first[j]), 0.0, 0) if n else (None, None, None)
        return MetricResult(
            name,
            policy,
            "match",
            ulp_dtype=_width(precision),
            steps_compared=n,
            exact_matches=n,
            max_abs_diff=zero,
            max_abs_diff_step=step,
            max_rel_diff=zero,
            max_rel_diff_step=step,
            max_ulp=none,
            max_ulp_step=step,
            precision=precision,
            note=f"judged at {_precision_words(precision)}" if precision != FLOAT64 else "",
        )

    def _where(self, name: str) -> int:
        if self._index is None:
            self._index = dict(zip(self._names, range(len(self._names)), strict=True))
        return self._index[name]

    def __getitem__(self, name: str) -> MetricResult:
        return self._at(self._where(name))

    def __contains__(self, name: object) -> bool:
        try:
            self._where(name)  # type: ignore[arg-type]
        except (KeyError, TypeError):
            return False
        return True

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def values(self) -> ValuesView[MetricResult]:
        return _Values(self)

    def items(self) -> ItemsView[str, MetricResult]:
        return _Items(self)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({dict(self.items())!r})"

    def failures(self) -> list[MetricResult]:
        """The results that failed, in this mapping's order."""
        return [self._at(j) for j in np.flatnonzero(~self._ok).tolist()]

    def failing(self) -> int:
        """How many results failed."""
        return int(np.count_nonzero(~self._ok))

    def counts(self) -> dict[str, int]:
        """Metrics per status, in _ORDER's order."""
        n = np.bincount(self._status, minlength=len(_ORDER))
        return {s: int(n[code]) for s, code in _ORDER.items()}

    def ordered(self, limit: int | None = None) -> list[MetricResult]:
        """The results failures first, then by status (_ORDER) and name; the first ``limit``."""
        order = np.lexsort((self._rank, self._status, self._ok))
        return [self._at(j) for j in order[:limit].tolist()]

    def judged_at(self) -> dict[str, list[str]]:
        """Precision coarser than float64 -> the judged (not ignored) metrics at it, by name."""
        which, texts = self._precision
        out = {}
        for code, p in sorted(enumerate(texts), key=lambda x: x[1]):
            hit = np.flatnonzero((which == code) & (self._status != _IGNORED))
            if p != FLOAT64 and len(hit):
                out[p] = [self._names[j] for j in hit[np.argsort(self._rank[hit])].tolist()]
        return out


class _Values(ValuesView):
    _mapping: MetricResults

    def __iter__(self) -> Iterator[MetricResult]:
        results = self._mapping
        return (results._at(j) for j in range(len(results)))


class _Items(ItemsView):
    _mapping: MetricResults

    def __iter__(self) -> Iterator[tuple[str, MetricResult]]:
        results = self._mapping
        return ((name, results._at(j)) for j, name in enumerate(results._names))


@dataclass
class Comparison:
    """All metrics' results; verdict "aligned" only when none of them failed.

    metrics: a MetricResults (a plain dict given is made one), read like a dict."""

    verdict: Literal["aligned", "diverged", "imprecise"]
    metrics: Mapping[str, MetricResult]
    a_source: str | None = None
    b_source: str | None = None
    steps_only_in_a: list[int] = field(default_factory=list)
    steps_only_in_b: list[int] = field(default_factory=list)
    reads: dict[str, dict[str, Any]] = field(default_factory=dict)  # side -> what was read

    def __post_init__(self) -> None:
        if not isinstance(self.metrics, MetricResults):
            self.metrics = MetricResults.of(self.metrics)

    @property
    def results(self) -> MetricResults:
        assert isinstance(self.metrics, MetricResults)
        return self.metrics

    @property
    def ok(self) -> bool:
        return self.verdict == "aligned"

    def verdict_text(self) -> str:
        """The verdict as printed: "aligned at 4 decimals" (or "at 6 significant digits") when a
        judged metric's sources hold fewer digits than a float (the user accepted judging at
        them), else the verdict."""
        rounded = [p for p in self.results.judged_at() if _rounded(p)]
        if self.verdict != "aligned" or not rounded:
            return self.verdict
        return "aligned at " + " and ".join(sorted({_precision_words(p) for p in rounded}))

    @property
    def failures(self) -> list[MetricResult]:
        return self.results.failures()

    def first_divergence(self) -> MetricResult | None:
        """The failed metric that went wrong earliest: the smallest first divergent step, ties
        by name; None when no failure has a step (aligned, or a metric missing on one side).
        The one rule the report, the diagnosis and bisect name "the first divergence" by."""
        bad = [m for m in self.failures if m.first_divergent_step is not None]
        return min(bad, key=lambda m: (m.first_divergent_step, m.name), default=None)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able (json.dumps(..., allow_nan=False)); non-finite floats become strings."""
        return {
            "verdict": self.verdict,
            "a": self.a_source,
            "b": self.b_source,
            "steps_only_in_a": json_value(self.steps_only_in_a),
            "steps_only_in_b": json_value(self.steps_only_in_b),
            "reads": self.reads,
            "metrics": {
                name: {k: json_value(getattr(m, k)) for k in _RESULT_FIELDS}
                for name, m in self.metrics.items()
            },
        }

    def table(self, max_rows: int = 20) -> str:
        """Fixed-width text table, failures first: the pytest failure message. Names, notes
        and paths (data from the logs) are printable(): one metric is one line."""
        counts = self.results.counts()
        lines = [
            f"verdict: {self.verdict_text()} ("
            + ", ".join(f"{n} {s}" for s, n in counts.items() if n)
            + f")  a={self.a_source}  b={self.b_source}"
        ]
        for side, steps in (("a", self.steps_only_in_a), ("b", self.steps_only_in_b)):
            if steps:
                lines.append(f"steps only in {side}: {_steps(steps)}")
        header = (
            "metric",
            "policy",
            "status",
            "compared",
            "first_diff",
            "a",
            "b",
            "max_ulp",
            "note",
        )
        shown = self.results.ordered(max_rows)
        cells = [
            (
                printable(m.name),
                printable(m.policy),
                m.status,
                str(m.steps_compared),
                _fmt(m.first_divergent_step),
                _fmt(m.a_value),
                _fmt(m.b_value),
                _fmt(m.max_ulp),
                printable(m.note),
            )
            for m in shown
        ]
        widths = [max(len(r[i]) for r in [header, *cells]) for i in range(len(header) - 1)]
        for r in [header, *cells]:  # the note column is last and not padded
            padded = [c.ljust(w) for c, w in zip(r[:-1], widths, strict=True)]
            lines.append("  ".join([*padded, r[-1]]).rstrip())
        rest = len(self.metrics) - len(shown)
        if rest > 0:
            failing = self.results.failing() - sum(not m.ok for m in shown)
            lines.append(f"... {rest} more metrics ({failing} failing)")
        return "\n".join(printable(line) for line in lines + self.read_lines())

    def read_lines(self) -> list[str]:
        """What each side's reader read, skipped and noted, and the metrics judged at a coarser
        precision than float64: the verdict is only as exact as the data."""
        lines = []
        for side, read in self.reads.items():
            if read.get("format"):
                lines.append(f"{side}: {read['summary']}")
            lines.extend(f"{side}: note: {n}" for n in read.get("notes", []))
        for p, names in self.results.judged_at().items():
            words = _precision_words(p)
            lines.append(f"judged at {words} (what the sources hold): {_names(names)}")
        return lines + self.imprecise_lines()

    def imprecise_lines(self, limit: int = 6) -> list[str]:
        """One line per metric whose policy needs more digits than its sources hold."""
        hit = [m for m in self.results.failures() if m.status == "imprecise"]
        lines = [
            f"{m.name}: source holds {_precision_words(m.precision)}; judged {m.policy} needs "
            f"the full value: {ADVICE}"
            for m in hit[:limit]
        ]
        if len(hit) > limit:
            lines.append(f"... {len(hit) - limit} more metrics judged beyond their sources")
        return lines


_ROUNDING_WORDS = {"decimals": "decimals", "digits": "significant digits"}


def _precision_words(p: str) -> str:
    """'float32', '5 decimals', 'float32 and 4 decimals', '6 significant digits'."""
    words = []
    for part in p.split(","):
        kind, _, count = part.partition(":")
        words.append(f"{count} {_ROUNDING_WORDS[kind]}" if kind in _ROUNDING_WORDS else part)
    return " and ".join(words)


def _width(precision: str) -> str:
    """The float type a precision's ULPs count in: its float width, else float64."""
    return next((p for p in precision.split(",") if p in ("float32", "float16")), FLOAT64)


def _names(names: list[str], limit: int = 6) -> str:
    return ", ".join(names[:limit]) + (f", ... ({len(names)} in all)" if len(names) > limit else "")


def _at_precision(x: np.ndarray, precision: str) -> tuple[np.ndarray, type]:
    """The values as the coarser source holds them, and the float type whose ULPs count: a
    float32 log is judged in float32 bits and ULPs, a rounded one after rounding both sides
    (a float width first, then decimals, then significant digits, where they apply)."""
    ulp_type: type = np.float64
    for part in precision.split(","):
        if part in ("float32", "float16"):
            ulp_type = np.float32 if part == "float32" else np.float16
            with np.errstate(over="ignore"):
                x = x.astype(ulp_type).astype(np.float64)
        elif part.startswith("decimals:"):
            n = int(part.split(":")[1])
            x = np.array([round(v, n) for v in x.tolist()], dtype=np.float64)
        elif part.startswith("digits:"):
            n = int(part.split(":")[1])
            x = np.array([float(f"{v:.{n}g}") for v in x.tolist()], dtype=np.float64)
    return x, ulp_type


def _float32_values(x: np.ndarray, y: np.ndarray) -> bool:
    """Whether both sides' finite values are all exactly float32 and not all integers: a
    float32 tensor's .item() logged as a Python float. Its ULPs are then counted in float32 (1,
    not 2**29 per float32 step); the comparison itself is unchanged, the values being exact."""
    v = np.concatenate([x[np.isfinite(x)], y[np.isfinite(y)]])
    if not len(v) or (v == np.round(v)).all():
        return False
    with np.errstate(over="ignore"):
        return bool((v.astype(np.float32).astype(np.float64) == v).all())


def needs_full_value(policy: Policy) -> bool:
    """Whether the policy judges some step exact: it then needs the value in full, which a
    rounded source does not hold. ulp:, close: and ignore are tolerances the user chose, but
    ulp:0 and close:0,0 tolerate nothing: exact in effect, they need the full value too (else
    `ulp:0` on a rounded log would read "aligned at 4 decimals" where `exact` is "imprecise"). A
    step policy without a fallback piece judges the steps no range holds exact."""
    if policy.kind == "steps":
        fallback = any(p.first is None and p.last is None for p in policy.pieces)
        return not fallback or any(needs_full_value(p.policy) for p in policy.pieces)
    if policy.kind == "ulp":
        return policy.ulp == 0
    if policy.kind == "close":
        return policy.rtol == 0 and policy.atol == 0
    return policy.kind == "exact"


def _rounded(precision: str) -> bool:
    """Whether a precision is a rounding to decimals or significant digits (a float width is
    judged in its bits)."""
    return "decimals:" in precision or "digits:" in precision


def _steps(steps: list[int], limit: int = 8) -> str:
    shown = ", ".join(map(str, steps[:limit]))
    return shown + (f", ... ({len(steps)} in all)" if len(steps) > limit else "")


def _judge(
    policy: Policy,
    steps: np.ndarray,
    x: np.ndarray,
    y: np.ndarray,
    same: np.ndarray,
    ulp: np.ndarray,
) -> np.ndarray:
    """Per step: within the policy in force at that step (vectorised, piece by piece)."""
    if policy.kind == "steps":
        which = piece_index(policy.pieces, steps)
        good = same.copy()  # steps that no piece holds are judged exact
        for i, piece in enumerate(policy.pieces):
            mask = which == i
            if mask.any():
                sub = (steps[mask], x[mask], y[mask], same[mask], ulp[mask])
                good[mask] = _judge(piece.policy, *sub)
        return good
    if policy.kind == "exact":
        return same
    if policy.kind == "ulp":
        return ulp <= np.uint64(policy.ulp)
    if policy.kind == "ignore":  # a piece of a step policy: these steps are not judged
        return np.ones(len(x), dtype=bool)
    return np.isclose(x, y, rtol=policy.rtol, atol=policy.atol, equal_nan=True)


def _ignored_steps(policy: Policy, steps: np.ndarray) -> np.ndarray | None:
    """Which of ``steps`` a step policy's ``ignore`` pieces hold (None for a policy with none):
    they are not judged, nor counted as compared; a metric whose every step is so is ignored
    (``ignore@0-`` on a run of steps 1..N is ``ignore``, and nothing compared is no verdict)."""
    if policy.kind != "steps" or not any(p.policy.kind == "ignore" for p in policy.pieces):
        return None
    ignore = np.array([p.policy.kind == "ignore" for p in policy.pieces] + [False])
    return ignore[piece_index(policy.pieces, steps)]  # -1 (no piece: exact) is the last


def _compare_metric(
    name: str,
    policy: Policy,
    steps: np.ndarray,
    a: np.ndarray | None,
    pa: np.ndarray,
    b: np.ndarray | None,
    pb: np.ndarray,
    allow_missing: bool,
    precision: str = FLOAT64,
    imprecise: bool = False,
) -> MetricResult:
    """One metric judged; imprecise: its policy needs more digits than its sources hold, so a
    metric within it at every step is "imprecise", not "match"."""
    res = MetricResult(name=name, policy=str(policy), status="match", precision=precision)
    if policy.kind == "ignore":
        res.status = "ignored"
        return res
    res.missing_in_a = [int(s) for s in steps[pb & ~pa]]
    res.missing_in_b = [int(s) for s in steps[pa & ~pb]]
    if a is None or b is None:
        res.status, res.ok = "missing", allow_missing
        res.note = f"metric absent from {'a' if a is None else 'b'}"
        return res
    both = pa & pb
    x, y, st = a[both], b[both], steps[both]
    x, ulp_type = _at_precision(x, precision)
    y, _ = _at_precision(y, precision)
    res.steps_compared = len(st)
    same = (x.view(np.uint64) == y.view(np.uint64)) | (np.isnan(x) & np.isnan(y))
    res.exact_matches = int(same.sum())
    # Distances are 0 where the bits agree, so they are computed only where they do not: a
    # parity run is mostly equal values, and those then cost one comparison each.
    diff = np.flatnonzero(~same)
    if ulp_type is np.float64 and len(diff) and _float32_values(x, y):
        ulp_type = np.float32  # where values differ: equal ones have no distance to count
    res.ulp_dtype = np.dtype(ulp_type).name
    every = len(diff) == len(x)  # then the whole arrays, not copies
    xd, yd = (x, y) if every else (x[diff], y[diff])
    ulp_d = ulp_distance(xd, yd, ulp_type)
    if every:
        ulp = ulp_d
    else:
        ulp = np.zeros(len(x), dtype=np.uint64)
        ulp[diff] = ulp_d
    good = _judge(policy, st, x, y, same, ulp)
    notes = []
    zero_sign = (xd == 0) & (yd == 0)
    if zero_sign.any():
        notes.append(f"sign of zero differs at step {int(st[diff[np.argmax(zero_sign)]])}")
    if len(st):
        with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
            absd = np.abs(xd - yd)  # NaN only from NaN or inf inputs, so only then mended
            mend = not np.isfinite(absd).all()
            if mend:
                absd = np.where(np.isnan(absd), np.inf, absd)
            scale = np.maximum(np.abs(xd), np.abs(yd))
            reld = np.where(absd == 0, 0.0, absd / scale)
            if mend:
                reld = np.where(np.isnan(reld), np.inf, reld)
        for field, d in (("max_abs_diff", absd), ("max_rel_diff", reld), ("max_ulp", ulp_d)):
            # the first largest; all zero (or no difference at all): 0 at the first step
            at = int(np.argmax(d)) if len(d) else 0
            top = d[at] if len(d) else d.dtype.type(0)
            i = int(diff[at]) if top > 0 else 0
            setattr(res, field, int(top) if field == "max_ulp" else float(top))
            setattr(res, f"{field}_step", int(st[i]))
    if precision != FLOAT64:
        notes.append(f"judged at {_precision_words(precision)}")
    bad = ~good
    res.divergent_steps = int(bad.sum())
    if res.divergent_steps:
        i = int(np.argmax(bad))
        res.status, res.ok = "diverged", False
        res.first_divergent_step = int(st[i])
        res.first_divergent_policy = policy.piece_at(res.first_divergent_step)
        res.a_value, res.b_value = float(x[i]), float(y[i])
        if policy.kind == "steps":
            notes.append(f"step {res.first_divergent_step} judged {res.first_divergent_policy}")
    elif res.missing_in_a or res.missing_in_b:
        res.status, res.ok = "missing", allow_missing
    elif imprecise and res.steps_compared:
        res.status, res.ok = "imprecise", False
        notes.append(f"source holds {_precision_words(precision)}: {policy} needs the full value")
    for side, miss in (("a", res.missing_in_a), ("b", res.missing_in_b)):
        if miss:
            notes.append(f"missing in {side} at steps {_steps(miss)}")
    res.note = "; ".join(notes)
    return res


def _metric_names(ka: list, kb: list, a: pd.DataFrame) -> list[str]:
    """Both frames' metric names (as str), sorted; in O(names) when both hold the same ones."""
    if ka == kb and a.columns.inferred_type == "string":
        return ka if a.columns.is_monotonic_increasing else sorted(ka)
    return sorted(set(map(str, ka)) | set(map(str, kb)))


def _aligned_mask(mask: pd.DataFrame, index: pd.Index, columns: pd.Index) -> np.ndarray:
    """attrs["present"] as booleans on the frame's own steps and columns (False where absent)."""
    values = mask.to_numpy()
    values = values if values.dtype == bool else values.astype(bool)
    if mask.index.equals(index) and mask.columns.equals(columns):
        return values
    rows, cols = mask.index.get_indexer(index), mask.columns.get_indexer(columns)
    out = np.zeros((len(index), len(columns)), dtype=bool)
    hit_r, hit_c = rows >= 0, cols >= 0
    out[np.ix_(hit_r, hit_c)] = values[np.ix_(rows[hit_r], cols[hit_c])]
    return out


def _side(
    frame: pd.DataFrame, steps: pd.Index, names: list[str], columns: list
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(values, present) as steps x columns arrays on all compared steps (NaN and False where
    the frame has no such step), and each name's column (-1: the frame lacks it; None: the
    columns are the names).

    Arrays, not frame[name]: selecting a column of a read frame deep-copies its attrs (the
    present mask among them), which made comparing N metrics cost N copies of the whole frame.
    """
    values = frame.to_numpy(dtype=np.float64)
    present = ~np.isnan(values)  # present_mask: a value is always present
    mask = frame.attrs.get("present")
    if isinstance(mask, pd.DataFrame) and mask.index.is_unique and mask.columns.is_unique:
        present |= _aligned_mask(mask, frame.index, frame.columns)
    if not frame.index.equals(steps):
        rows = steps.get_indexer(frame.index)
        full = np.full((len(steps), values.shape[1]), np.nan)
        full[rows] = values
        has = np.zeros(full.shape, dtype=bool)
        has[rows] = present
        values, present = full, has
    if columns is names or columns == names:
        return values, present, None
    at = {c: i for i, c in enumerate(columns) if isinstance(c, str)}
    return values, present, np.array([at.get(n, -1) for n in names], dtype=np.int64)


def _precisions(a: pd.DataFrame, b: pd.DataFrame, names: list[str]) -> tuple[np.ndarray, list[str]]:
    """Each metric's precision (the coarser of its two sources'), as an index into texts."""
    pa, pb = a.attrs.get("precision") or {}, b.attrs.get("precision") or {}
    which = np.zeros(len(names), dtype=np.int64)
    texts = [FLOAT64]
    if set(pa.values()) | set(pb.values()) <= {FLOAT64}:
        return which, texts
    code: dict[tuple[str, str], int] = {}
    for j, name in enumerate(names):
        key = (pa.get(name, FLOAT64), pb.get(name, FLOAT64))
        if key not in code:
            p = coarser(*key)
            if p not in texts:
                texts.append(p)
            code[key] = texts.index(p)
        which[j] = code[key]
    return which, texts


def _clean(
    x: np.ndarray, has_a: np.ndarray, y: np.ndarray, has_b: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per column of a's values x against b's y (steps x metrics): whether it is clean (present
    at the same steps, equal bits or NaN on both sides wherever present), how many steps it has
    and the row of its first."""
    everywhere = has_a.all() and has_b.all()  # the usual frame: no cell absent
    same_steps = np.ones(x.shape[1], dtype=bool) if everywhere else (has_a == has_b).all(axis=0)
    agree = x.view(np.uint64) == y.view(np.uint64)
    if not everywhere:
        agree |= ~has_a
    clean = same_steps & agree.all(axis=0)
    nan = np.flatnonzero(same_steps & ~clean)  # maybe a NaN on both sides: look again
    if len(nan):
        sx, sy = x[:, nan], y[:, nan]
        again = (sx.view(np.uint64) == sy.view(np.uint64)) | (np.isnan(sx) & np.isnan(sy))
        clean[nan] = (again | ~has_a[:, nan]).all(axis=0)
    if everywhere or not len(x):
        return clean, np.full(x.shape[1], len(x)), np.zeros(x.shape[1], dtype=np.int64)
    return clean, has_a.sum(axis=0), has_a.argmax(axis=0)


def compare_frames(
    a: pd.DataFrame,
    b: pd.DataFrame,
    policies: Mapping[str, Policy | str] | None = None,
    *,
    allow_missing: bool = False,
    allow_incomplete: bool = False,
    allow_skipped: bool = False,
    at_source_precision: bool = False,
    allow_nothing_compared: bool = False,
) -> Comparison:
    """Compare every metric of two canonical frames (see parity.readers) under its policy.

    policies: metric name or fnmatch glob -> Policy or its text; an exact name beats a glob,
    globs are tried in mapping order, and unmatched metrics get default_policy. Metrics or steps
    present on one side only fail (status "missing") unless allow_missing. A side read from an
    incomplete run (attrs["complete"] is False) raises IncompleteRunError unless allow_incomplete;
    a side whose reader skipped records raises SkippedRecordsError unless allow_skipped (no
    verdict from a partial read). Each metric is judged at the coarser precision of its two
    sources (attrs["precision"]): a float32 log in float32 bits and ULPs, a rounded one rounded.
    A rounded source under a policy that judges a step exact (needs_full_value) gives verdict
    "imprecise" (the source cannot tell 1 ULP apart), unless at_source_precision accepts
    judging at its decimals (digits). ulp:0 and close:0,0 count as exact. Values that are all
    exactly float32 count their ULPs in float32.
    No metric judged at any step (every one ignored) raises NothingComparedError unless
    allow_nothing_compared: "aligned" would say nothing.

    The frames are read as arrays once; the metrics equal at every step are told apart from the
    rest over all of them at once, and only the rest are judged one by one (_compare_metric).
    """
    for side, frame in (("a", a), ("b", b)):
        if frame.attrs.get("complete") is False and not allow_incomplete:
            why = frame.attrs.get("incomplete") or "no end record"
            raise IncompleteRunError(
                printable(
                    f"{frame.attrs.get('source', side)}: run is incomplete ({why}); "
                    "--allow-incomplete to compare anyway"
                )
            )
        if skipped_count(frame) and not allow_skipped:
            notes = [n for n in frame.attrs.get("notes") or [] if n.startswith("first ")]
            raise SkippedRecordsError(
                f"{frame.attrs.get('source', side)}: {read_summary(frame, side)}"
                + (f"; {notes[0]}" if notes else "")
                + "; no verdict from a partial read (--allow-skipped to compare anyway)"
            )
        if not frame.index.is_unique or not frame.columns.is_unique:
            raise MetricsError(f"frame {side}: steps and metric names must be unique")
    policies = parse_policies(policies)  # a bad text fails here, even if it matches nothing
    a, b = align_step_labels(a, b)  # steps that are labels ([epoch, iteration]): by label
    steps_index = a.index.union(b.index).sort_values()
    steps = np.asarray(steps_index, dtype=np.int64)
    ka, kb = a.columns.tolist(), b.columns.tolist()
    names = _metric_names(ka, kb, a)
    va, pa, ca = _side(a, steps_index, names, ka)
    vb, pb, cb = _side(b, steps_index, names, kb)
    which, distinct = resolve_all(names, policies)
    skips = [_ignored_steps(p, steps) for p in distinct]  # steps a step policy's ignore holds
    whole = [p.kind == "ignore" or (m is not None and bool(m.all())) for p, m in zip(
        distinct, skips, strict=True)]  # fmt: skip
    ignored = np.array(whole, dtype=bool)[which]
    precision = _precisions(a, b, names)
    needs = np.array([needs_full_value(p) for p in distinct], dtype=bool)[which]
    rounded = np.array([_rounded(t) for t in precision[1]], dtype=bool)[precision[0]]
    imprecise = needs & rounded & ~ignored & (not at_source_precision)

    every = np.arange(len(names))
    ca, cb = every if ca is None else ca, every if cb is None else cb
    judged = np.flatnonzero(~ignored & (ca >= 0) & (cb >= 0))
    if len(judged) == len(names) and (ca is every) and (cb is every):
        clean, count, first = _clean(va, pa, vb, pb)  # every metric, in the frames' order
    else:
        ja, jb = ca[judged], cb[judged]
        clean, count, first = _clean(va[:, ja], pa[:, ja], vb[:, jb], pb[:, jb])
    counts = np.zeros(len(names), dtype=np.int64)
    firsts = np.zeros(len(names), dtype=np.int64)
    counts[judged] = count
    if len(steps):
        firsts[judged] = steps[first]
    lazy = ignored.copy()
    lazy[judged[clean]] = True
    lazy &= ~imprecise  # a rounded source's metric is judged one by one, to say so
    status = np.where(ignored, _IGNORED, _MATCH).astype(np.int8)
    ok = np.ones(len(names), dtype=bool)
    built: list[MetricResult | None] = [None] * len(names)
    none = np.zeros(len(steps), dtype=bool)
    for j in np.flatnonzero(~lazy).tolist():
        cols = []
        for values, present, at in ((va, pa, ca[j]), (vb, pb, cb[j])):
            has = at >= 0
            cols += [values[:, at].copy() if has else None, present[:, at].copy() if has else none]
        res = _compare_metric(
            names[j],
            distinct[which[j]],
            steps,
            *cols,
            allow_missing,
            precision[1][precision[0][j]],
            bool(imprecise[j]),
        )
        built[j], status[j], ok[j] = res, _ORDER[res.status], res.ok
        counts[j] = res.steps_compared
    for j in np.flatnonzero(~ignored & (ca >= 0) & (cb >= 0)).tolist():
        skip = skips[which[j]]
        if skip is not None:  # the steps a piece ignores are not compared ones
            counts[j] = int((pa[:, ca[j]] & pb[:, cb[j]] & ~skip).sum())
            if built[j] is not None:
                built[j].steps_compared = int(counts[j])
    texts = [str(p) for p in distinct]
    results = MetricResults(names, built, status, ok, precision, (which, texts, counts, firsts))
    only_a = [int(s) for s in a.index.difference(b.index)]
    only_b = [int(s) for s in b.index.difference(a.index)]
    imprecise_code = _ORDER["imprecise"]
    failed = (~ok & (status != imprecise_code)).any() or bool(
        (only_a or only_b) and not allow_missing
    )
    if not failed and not counts.any() and not allow_nothing_compared:
        raise NothingComparedError(_nothing_compared(a, b, names, ignored))
    verdict = (
        "diverged" if failed else "imprecise" if (status == imprecise_code).any() else "aligned"
    )
    return Comparison(
        verdict=verdict,
        metrics=results,
        a_source=a.attrs.get("source"),
        b_source=b.attrs.get("source"),
        steps_only_in_a=only_a,
        steps_only_in_b=only_b,
        reads={side: _read_info(frame, side) for side, frame in (("a", a), ("b", b))},
    )


def compare_runs(
    a: str | os.PathLike[str],
    b: str | os.PathLike[str],
    policies: Mapping[str, Policy | str] | None = None,
    *,
    fmt: str | None = None,
    run_a: str | None = None,
    run_b: str | None = None,
    duplicates: str = "error",
    allow_missing: bool = False,
    allow_incomplete: bool = False,
    allow_skipped: bool = False,
    at_source_precision: bool = False,
) -> Comparison:
    """What `parity compare` does: two metric files or run folders (any format a reader
    claims, or ``fmt``) read and compared under ``policies``; run_a, run_b: the run to read in
    a folder holding several; the rest as compare_frames takes them. Raises MetricsError (a
    file that cannot be read) or IncompleteRunError / SkippedRecordsError (no verdict from a
    partial read)."""
    frames = [read_metrics(path, fmt, run=run, duplicates=duplicates)
              for path, run in ((a, run_a), (b, run_b))]  # fmt: skip
    return compare_frames(
        *frames, policies, allow_missing=allow_missing, allow_incomplete=allow_incomplete,
        allow_skipped=allow_skipped, at_source_precision=at_source_precision,
    )  # fmt: skip


def _nothing_compared(a: pd.DataFrame, b: pd.DataFrame, names: list[str], ignored) -> str:
    """The one line saying why no metric was judged at any step."""
    sources = f"{a.attrs.get('source', 'a')} vs {b.attrs.get('source', 'b')}"
    if len(names) and ignored.all():
        why = f"every metric is ignored ({_names(names)})"
    elif not len(names):
        why = "neither side holds a metric"
    else:
        why = "no metric judged has a step on both sides"
    return printable(f"{sources}: nothing compared: {why}; no verdict")


def _read_info(frame: pd.DataFrame, side: str) -> dict[str, Any]:
    """What a side's reader read and skipped (JSON-able), with its one-line summary."""
    return {
        "format": frame.attrs.get("format"),
        "steps": len(frame.index),
        "skipped": list(frame.attrs.get("skipped") or []),
        "notes": list(frame.attrs.get("notes") or []),
        "summary": read_summary(frame, side),
    }
