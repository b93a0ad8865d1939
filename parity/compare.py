"""Compare two canonical metric frames metric by metric: policies, ULP distance, first divergence.

ULP distance puts every float64 on one ordered integer line, so adjacent floats are 1 apart,
also across zero (-5e-324 and 5e-324 are 2 apart). -0.0 and +0.0 are the same point on that
line (distance 0); the "exact" policy still tells them apart and says "sign of zero differs".
NaN is 0 from NaN and ULP_MAX from anything else; an infinity is ULP_MAX from anything but
itself.
"""

from __future__ import annotations

import fnmatch
import math
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import numpy as np
import pandas as pd

from parity.readers import (
    IncompleteRunError,
    MetricsError,
    SkippedRecordsError,
    present_mask,
    read_summary,
    skipped_count,
)
from parity.readers.frame import FLOAT64, coarser

__all__ = [
    "ULP_MAX",
    "Comparison",
    "IncompleteRunError",
    "MetricResult",
    "MetricsError",
    "Policy",
    "SkippedRecordsError",
    "StepRange",
    "compare_frames",
    "default_policy",
    "ulp_distance",
]

ULP_MAX = int(np.iinfo(np.uint64).max)
_SIGN = np.uint64(1 << 63)
_MAGNITUDE = np.int64((1 << 63) - 1)
# Run-to-run noise in the stacks people bring (verl, torchtitan, Megatron, HF, Lightning, NeMo):
# time, throughput and memory never reproduce, so by default they are ignored and listed as such.
_NOISE = (
    "mfu",
    "time",
    "timing",
    "throughput",
    "tokens_per_s",
    "tokens/s",
    "tokens_per_sec",
    "samples_per_second",
    "steps_per_second",
    "per_second",
    "_per_sec",  # Lightning's ThroughputMonitor: samples_per_sec, batches_per_sec, items_per_sec
    "samples/s",
    "it/s",
    "tflops",
    "flops",
    "memory",
    "allocated_bytes",  # Lightning's DeviceStatsMonitor
    "reserved_bytes",
    "mem-",
    "mem_",
    "/mem",
    "perf/",
)
_NOISE_EXACT = ("tps", "wps", "mfu")  # whole names only ("outputs" holds "tps")
_RATE = ("/s", "per_s", "_s/", "time", "tps", "wps")
_ORDER = {"diverged": 0, "missing": 1, "match": 2, "ignored": 3}


def _ordered(x: np.ndarray) -> np.ndarray:
    """float64 bits -> uint64 keys in the order of the reals; both zeros map to 2**63.

    The key is 2**63 + (the magnitude bits, negated for a set sign bit), in four passes over
    the array rather than a select between two computed arrays (half the time).
    """
    i = np.asarray(x, dtype=np.float64).view(np.int64)
    sign = i >> 63  # -1 where the sign bit is set, else 0
    signed = i ^ (sign & _MAGNITUDE)  # negative: -1 - magnitude
    signed -= sign  # negative: -magnitude; -0.0 and +0.0 both 0
    return signed.view(np.uint64) ^ _SIGN


def _ordered_narrow(x: np.ndarray, dtype: type) -> np.ndarray:
    """As _ordered, for float32 or float16 values (their own ULPs), widened to uint64 keys."""
    ints = {np.float32: np.int32, np.float16: np.int16}[dtype]
    i = np.asarray(x, dtype=dtype).view(ints).astype(np.int64)
    bits = np.dtype(ints).itemsize * 8
    magnitude = np.int64((1 << (bits - 1)) - 1)
    neg = i < 0
    signed = np.where(neg, -(i & magnitude), i)
    return (signed + (np.int64(1) << 62)).astype(np.uint64)


def ulp_distance(a: np.ndarray, b: np.ndarray, dtype: type = np.float64) -> np.ndarray:
    """Elementwise distance in units in the last place of ``dtype`` (float64, float32 or
    float16; uint64), symmetric, ±0 equal. A float32 source is judged in float32 ULPs."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if dtype is np.float64:
        ka, kb = _ordered(a), _ordered(b)
    else:
        with np.errstate(over="ignore"):
            ka, kb = (
                _ordered_narrow(a.astype(dtype), dtype),
                _ordered_narrow(b.astype(dtype), dtype),
            )
    d = np.maximum(ka, kb) - np.minimum(ka, kb)
    if np.isfinite(a).all() and np.isfinite(b).all():  # the usual case: no NaN or inf to mend
        return d
    with np.errstate(invalid="ignore"):
        far = ((np.isinf(a) | np.isinf(b)) & (a != b)) | (np.isnan(a) != np.isnan(b))
    d = np.where(far, np.uint64(ULP_MAX), d)
    return np.where(np.isnan(a) & np.isnan(b), np.uint64(0), d)


@dataclass(frozen=True)
class StepRange:
    """One piece of a step policy: ``policy`` judges steps first..last (None: open end).

    A piece with neither bound is the fallback for steps that no ranged piece covers.
    """

    first: int | None
    last: int | None
    policy: Policy

    def covers(self, steps: np.ndarray) -> np.ndarray:
        mask = np.ones(len(steps), dtype=bool)
        if self.first is not None:
            mask &= steps >= self.first
        if self.last is not None:
            mask &= steps <= self.last
        return mask

    def __str__(self) -> str:
        if self.first is None and self.last is None:
            return str(self.policy)
        if self.first is not None and self.first == self.last:
            return f"{self.policy}@{self.first}"
        lo = "" if self.first is None else str(self.first)
        hi = "" if self.last is None else str(self.last)
        return f"{self.policy}@{lo}-{hi}"


_KINDS = ("exact", "ulp", "close", "ignore", "steps")
# a comma that starts a new piece of a step policy (close:RTOL,ATOL has commas of its own)
_PIECE = re.compile(r",\s*(?=(?:exact|ulp|close|ignore)\b)")
_RANGE = re.compile(r"\s*(?:(?P<one>\d+)|(?P<lo>\d*)\s*-\s*(?P<hi>\d*))\s*")


@dataclass(frozen=True)
class Policy:
    """How one metric is judged: exact bits, within K ULP, numpy isclose, or not at all;
    kind "steps" judges each step by the piece whose range holds it (``pieces``)."""

    kind: Literal["exact", "ulp", "close", "ignore", "steps"] = "exact"
    ulp: int = 0
    rtol: float = 0.0
    atol: float = 0.0
    pieces: tuple[StepRange, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"bad policy kind {self.kind!r}")
        if isinstance(self.ulp, bool) or not isinstance(self.ulp, int) or self.ulp < 0:
            raise ValueError(f"bad policy: ulp must be a non-negative integer, got {self.ulp!r}")
        for name in ("rtol", "atol"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"bad policy: {name} must be finite and >= 0, got {v!r}")
        object.__setattr__(self, "pieces", tuple(self.pieces))
        if (self.kind == "steps") != bool(self.pieces):
            raise ValueError("bad policy: pieces go with kind 'steps', and only with it")
        if self.pieces:
            _check_pieces(self.pieces)

    @classmethod
    def parse(cls, text: str) -> Policy:
        """'exact' | 'ulp:K' | 'close:RTOL,ATOL' (or 'close:RTOL') | 'ignore', or a step policy.

        A step policy is pieces joined by commas, each a policy with a step range after '@':
        '@A-B', '@A-' (A on), '@-B' (up to B) or '@N' (one step); e.g. 'exact@-5,ulp:4@6-' is
        exact up to step 5, then within 4 ULP. Ranges may not overlap. At most one piece has no
        range and judges the steps no range covers; without it those steps are judged exact.
        Steps change because some differences are legitimate only later (a reordered reduction
        that grows with training), and the strict part should stay strict.
        """
        texts = _PIECE.split(text.strip())
        if len(texts) == 1 and "@" not in text:
            return _parse_simple(text, text)
        pieces = []
        for piece in texts:
            body, at, steps = piece.partition("@")
            policy = _parse_simple(body, text)
            if not at:
                pieces.append(StepRange(None, None, policy))
                continue
            m = _RANGE.fullmatch(steps)
            if not m or (m["one"] is None and not (m["lo"] or m["hi"])):
                raise ValueError(
                    f"bad policy {text!r}: step range {steps.strip()!r} is not N, A-B, A- or -B"
                )
            lo, hi = (m["one"], m["one"]) if m["one"] is not None else (m["lo"], m["hi"])
            pieces.append(StepRange(int(lo) if lo else None, int(hi) if hi else None, policy))
        try:
            return cls("steps", pieces=tuple(pieces))
        except ValueError as e:
            why = str(e).removeprefix("bad policy: ")
            raise ValueError(f"bad policy {text!r}: {why}") from None

    def piece_at(self, step: int) -> str:
        """The policy in force at ``step``, as text (a step policy's piece, with its range)."""
        if self.kind != "steps":
            return str(self)
        index = int(_piece_index(self.pieces, np.array([step], dtype=np.int64))[0])
        return str(self.pieces[index]) if index >= 0 else "exact (no range holds the step)"

    def __str__(self) -> str:
        if self.kind == "steps":
            return ",".join(map(str, self.pieces))
        if self.kind == "ulp":
            return f"ulp:{self.ulp}"
        if self.kind == "close":
            return f"close:{self.rtol!r},{self.atol!r}"
        return self.kind


def _parse_simple(piece: str, text: str) -> Policy:
    kind, sep, arg = piece.strip().partition(":")
    try:
        if kind in ("exact", "ignore") and not sep:
            return Policy(kind)
        if kind == "ulp" and arg.strip().isdigit():
            return Policy("ulp", ulp=int(arg))
        if kind == "close" and arg:
            parts = [float(p) for p in arg.split(",")]
            if len(parts) in (1, 2):
                return Policy("close", rtol=parts[0], atol=parts[1] if len(parts) == 2 else 0.0)
    except ValueError:
        pass
    raise ValueError(
        f"bad policy {text!r}: expected exact, ulp:K, close:RTOL,ATOL or ignore, "
        "optionally with @STEPS pieces (exact@-5,ulp:4@6-)"
    )


def _check_pieces(pieces: tuple[StepRange, ...]) -> None:
    """Simple policies, at most one fallback, sane and disjoint ranges."""
    if any(p.policy.kind == "steps" for p in pieces):
        raise ValueError("bad policy: a piece of a step policy cannot be a step policy")
    ranged = [p for p in pieces if p.first is not None or p.last is not None]
    if len(pieces) - len(ranged) > 1:
        raise ValueError("bad policy: more than one piece without a step range")
    for p in ranged:
        if p.first is not None and p.last is not None and p.first > p.last:
            raise ValueError(f"bad policy: empty step range in {p}")
    ranged.sort(key=lambda p: -1 if p.first is None else p.first)
    for prev, cur in zip(ranged, ranged[1:], strict=False):
        if prev.last is None or cur.first is None or cur.first <= prev.last:
            raise ValueError(f"bad policy: step ranges of {prev} and {cur} overlap")


def _piece_index(pieces: tuple[StepRange, ...], steps: np.ndarray) -> np.ndarray:
    """For each step, the index of the piece in force; -1 where none is (judged exact)."""
    which = np.full(len(steps), -1, dtype=np.int64)
    for i, p in enumerate(pieces):  # the fallback first: ranged pieces override it
        if p.first is None and p.last is None:
            which[:] = i
    for i, p in enumerate(pieces):
        if p.first is not None or p.last is not None:
            which[p.covers(steps)] = i
    return which


def default_policy(metric: str) -> Policy:
    """Run-to-run noise (time, throughput, memory, mfu: ``_NOISE``) is ignored, since it never
    reproduces; everything else is exact."""
    name = metric.lower()
    leaf = name.rsplit("/", 1)[-1]
    noisy = any(t in name for t in _NOISE) or leaf in _NOISE_EXACT
    counter = "tokens" in leaf and not any(r in name for r in _RATE)  # perf/total_num_tokens
    return Policy("ignore") if noisy and not counter else Policy("exact")


def _resolve(metric: str, policies: Mapping[str, Policy | str]) -> Policy:
    """Exact name first, then the first matching glob in mapping order, then the default."""
    chosen = policies.get(metric)
    if chosen is None:
        chosen = next(
            (p for pat, p in policies.items() if fnmatch.fnmatchcase(metric, pat)),
            None,
        )
    if chosen is None:
        return default_policy(metric)
    return chosen if isinstance(chosen, Policy) else Policy.parse(chosen)


@dataclass
class MetricResult:
    """One metric's verdict and where it first went wrong."""

    name: str
    policy: str
    status: Literal["match", "diverged", "ignored", "missing"]
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
    note: str = ""


def _json(v: Any) -> Any:
    if isinstance(v, (float, np.floating)):
        return float(v) if math.isfinite(v) else repr(float(v))
    if isinstance(v, np.integer):
        return int(v)
    if isinstance(v, list):
        return [_json(x) for x in v]
    return v


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, int) and v == ULP_MAX:
        return "max"
    return repr(v)


@dataclass
class Comparison:
    """All metrics' results; verdict "aligned" only when none of them failed."""

    verdict: Literal["aligned", "diverged"]
    metrics: dict[str, MetricResult]
    a_source: str | None = None
    b_source: str | None = None
    steps_only_in_a: list[int] = field(default_factory=list)
    steps_only_in_b: list[int] = field(default_factory=list)
    reads: dict[str, dict[str, Any]] = field(default_factory=dict)  # side -> what was read

    @property
    def ok(self) -> bool:
        return self.verdict == "aligned"

    @property
    def failures(self) -> list[MetricResult]:
        return [m for m in self.metrics.values() if not m.ok]

    def to_dict(self) -> dict[str, Any]:
        """JSON-able (json.dumps(..., allow_nan=False)); non-finite floats become strings."""
        return {
            "verdict": self.verdict,
            "a": self.a_source,
            "b": self.b_source,
            "steps_only_in_a": _json(self.steps_only_in_a),
            "steps_only_in_b": _json(self.steps_only_in_b),
            "reads": self.reads,
            "metrics": {
                name: {k: _json(v) for k, v in asdict(m).items() if k != "name"}
                for name, m in self.metrics.items()
            },
        }

    def table(self, max_rows: int = 20) -> str:
        """Fixed-width text table, failures first: the pytest failure message."""
        rows = sorted(self.metrics.values(), key=lambda m: (m.ok, _ORDER[m.status], m.name))
        counts = {s: sum(m.status == s for m in rows) for s in _ORDER}
        lines = [
            f"verdict: {self.verdict} ("
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
        cells = [
            (
                m.name,
                m.policy,
                m.status,
                str(m.steps_compared),
                _fmt(m.first_divergent_step),
                _fmt(m.a_value),
                _fmt(m.b_value),
                _fmt(m.max_ulp),
                m.note,
            )
            for m in rows[:max_rows]
        ]
        widths = [max(len(r[i]) for r in [header, *cells]) for i in range(len(header) - 1)]
        for r in [header, *cells]:  # the note column is last and not padded
            padded = [c.ljust(w) for c, w in zip(r[:-1], widths, strict=True)]
            lines.append("  ".join([*padded, r[-1]]).rstrip())
        if len(rows) > max_rows:
            rest = rows[max_rows:]
            lines.append(f"... {len(rest)} more metrics ({sum(not m.ok for m in rest)} failing)")
        return "\n".join(lines + self.read_lines())

    def read_lines(self) -> list[str]:
        """What each side's reader read, skipped and noted, and the metrics judged at a coarser
        precision than float64: the verdict is only as exact as the data."""
        rows = sorted(self.metrics.values(), key=lambda m: m.name)
        lines = []
        for side, read in self.reads.items():
            if read.get("format"):
                lines.append(f"{side}: {read['summary']}")
            lines.extend(f"{side}: note: {n}" for n in read.get("notes", []))
        for p in sorted({m.precision for m in rows if m.precision != FLOAT64}):
            names = [m.name for m in rows if m.precision == p and m.status != "ignored"]
            if names:
                words = _precision_words(p)
                lines.append(f"judged at {words} (what the sources hold): {_names(names)}")
        return lines


def _precision_words(p: str) -> str:
    """'float32', '5 decimals', 'float32 and 4 decimals'."""
    return " and ".join(
        f"{x.split(':')[1]} decimals" if x.startswith("decimals:") else x for x in p.split(",")
    )


def _names(names: list[str], limit: int = 6) -> str:
    return ", ".join(names[:limit]) + (f", ... ({len(names)} in all)" if len(names) > limit else "")


def _at_precision(x: np.ndarray, precision: str) -> tuple[np.ndarray, type]:
    """The values as the coarser source holds them, and the float type whose ULPs count: a
    float32 log is judged in float32 bits and ULPs, a rounded one after rounding both sides
    (a float width first, then decimals, where both apply)."""
    ulp_type: type = np.float64
    for part in precision.split(","):
        if part in ("float32", "float16"):
            ulp_type = np.float32 if part == "float32" else np.float16
            with np.errstate(over="ignore"):
                x = x.astype(ulp_type).astype(np.float64)
        elif part.startswith("decimals:"):
            n = int(part.split(":")[1])
            x = np.array([round(v, n) for v in x.tolist()], dtype=np.float64)
    return x, ulp_type


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
        which = _piece_index(policy.pieces, steps)
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
) -> MetricResult:
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
    for side, miss in (("a", res.missing_in_a), ("b", res.missing_in_b)):
        if miss:
            notes.append(f"missing in {side} at steps {_steps(miss)}")
    res.note = "; ".join(notes)
    return res


def compare_frames(
    a: pd.DataFrame,
    b: pd.DataFrame,
    policies: Mapping[str, Policy | str] | None = None,
    *,
    allow_missing: bool = False,
    allow_incomplete: bool = False,
    allow_skipped: bool = False,
) -> Comparison:
    """Compare every metric of two canonical frames (see parity.readers) under its policy.

    policies: metric name or fnmatch glob -> Policy or its text; an exact name beats a glob,
    globs are tried in mapping order, and unmatched metrics get default_policy. Metrics or steps
    present on one side only fail (status "missing") unless allow_missing. A side read from an
    incomplete run (attrs["complete"] is False) raises IncompleteRunError unless allow_incomplete;
    a side whose reader skipped records raises SkippedRecordsError unless allow_skipped (no
    verdict from a partial read). Each metric is judged at the coarser precision of its two
    sources (attrs["precision"]): a float32 log in float32 bits and ULPs, a rounded one rounded.
    """
    for side, frame in (("a", a), ("b", b)):
        if frame.attrs.get("complete") is False and not allow_incomplete:
            raise IncompleteRunError(
                f"{frame.attrs.get('source', side)}: run is incomplete (no end record); "
                "pass allow_incomplete to compare anyway"
            )
        if skipped_count(frame) and not allow_skipped:
            notes = [n for n in frame.attrs.get("notes") or [] if n.startswith("first ")]
            raise SkippedRecordsError(
                f"{frame.attrs.get('source', side)}: {read_summary(frame, side)}"
                + (f"; {notes[0]}" if notes else "")
                + "; no verdict from a partial read (--allow-skipped to compare anyway)"
            )
        if not frame.index.is_unique or not frame.columns.is_unique:
            raise ValueError(f"frame {side}: steps and metric names must be unique")
    policies = policies or {}
    for p in policies.values():  # bad policy text fails early, even if it matches nothing
        if not isinstance(p, Policy):
            Policy.parse(p)
    steps_index = a.index.union(b.index).sort_values()
    steps = np.asarray(steps_index, dtype=np.int64)
    present = {}
    for side, frame in (("a", a), ("b", b)):
        mask = present_mask(frame).reindex(index=steps_index, fill_value=False)
        present[side] = mask.astype(bool)
    results: dict[str, MetricResult] = {}
    names = sorted(set(map(str, a.columns)) | set(map(str, b.columns)))
    none = np.zeros(len(steps), dtype=bool)
    for name in names:
        cols = {}
        for side, frame in (("a", a), ("b", b)):
            if name in frame.columns:
                values = frame[name].reindex(steps_index).to_numpy(dtype=np.float64)
                cols[side] = (values, present[side][name].to_numpy())
            else:
                cols[side] = (None, none)
        precision = coarser(
            (a.attrs.get("precision") or {}).get(name, FLOAT64),
            (b.attrs.get("precision") or {}).get(name, FLOAT64),
        )
        results[name] = _compare_metric(
            name,
            _resolve(name, policies),
            steps,
            *cols["a"],
            *cols["b"],
            allow_missing,
            precision,
        )
    only_a = [int(s) for s in a.index.difference(b.index)]
    only_b = [int(s) for s in b.index.difference(a.index)]
    failed = any(not r.ok for r in results.values()) or bool(
        (only_a or only_b) and not allow_missing
    )
    return Comparison(
        verdict="diverged" if failed else "aligned",
        metrics=results,
        a_source=a.attrs.get("source"),
        b_source=b.attrs.get("source"),
        steps_only_in_a=only_a,
        steps_only_in_b=only_b,
        reads={side: _read_info(frame, side) for side, frame in (("a", a), ("b", b))},
    )


def _read_info(frame: pd.DataFrame, side: str) -> dict[str, Any]:
    """What a side's reader read and skipped (JSON-able), with its one-line summary."""
    return {
        "format": frame.attrs.get("format"),
        "steps": len(frame.index),
        "skipped": list(frame.attrs.get("skipped") or []),
        "notes": list(frame.attrs.get("notes") or []),
        "summary": read_summary(frame, side),
    }
