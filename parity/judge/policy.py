"""Per-metric policies: how each metric is judged (exact bits, K ULP, numpy isclose, ignored,
or by step ranges), the policy grammar (`ulp:2`, `exact@-3,ulp:1@4-`), the default for timing
and throughput metrics (ignored: NOISE_PATTERNS) and for counters (judged exactly), and which
of a spec's glob patterns names a metric.
"""

from __future__ import annotations

import fnmatch
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import numpy as np

from parity.errors import PolicyError
from parity.judge.ulp import ULP_MAX
from parity.readers.frame import MAX_STEP

__all__ = [
    "JUDGED_COUNTERS", "NOISE_KEYWORDS", "NOISE_PATTERNS", "Policy", "PolicyError", "StepRange",
    "default_policy", "noise_mask", "piece_index", "resolve_all", "resolve_policy",
]  # fmt: skip

NOISE_PATTERNS: tuple[str, ...] = (
    # a group: every metric whose name starts with these segments
    "perf/**",  # verl: perf/mfu/actor, perf/throughput, perf/max_memory_allocated_gb
    "timing/**",
    "timing_s/**",  # verl's timers: timing_s/step, timing_s/gen
    "timing_per_token_ms/**",  # verl
    "time/**",  # Composer: time/train, time/remaining_estimate
    "time_metrics/**",  # torchtitan: time_metrics/end_to_end(s)
    "memory/**",  # torchtitan: memory/max_reserved(GiB)
    "throughput/**",  # Composer: throughput/batches_per_sec
    "system/**",  # MLflow's system metrics: system/gpu_0_memory_usage_megabytes
    "devicestatsmonitor/**",  # Lightning: DeviceStatsMonitor.on_train_batch_end/...
    # time, as the last segment
    "time",  # Lightning's ThroughputMonitor: train/time
    "runtime",
    "*_runtime",  # HF: train_runtime, eval_runtime
    "*_time",  # step_time, iteration_time, data_time
    "*-time",  # Megatron: iteration-time
    "*_time_s",
    "*_time_ms",
    "time_per_*",
    "time_this_iter_s",  # Ray Train
    "time_total_s",
    "*_timing",
    "*_timing in s",  # NeMo: train_step_timing in s
    "*_timing_*",  # Megatron's golden values: iteration_timing_avg
    "timestamp",
    "*_timestamp",
    "elapsed",
    "elapsed_*",
    "*_elapsed",
    # rates
    "*_per_second",  # HF: train_samples_per_second
    "*_per_second_*",
    "*_per_sec",  # Lightning's ThroughputMonitor: samples_per_sec
    "*_per_sec_*",  # NeMo: tflops_per_sec_per_gpu
    "*_per_s",
    "*_per_s_*",
    "tokens/s",
    "samples/s",
    "steps/s",
    "batches/s",
    "items/s",
    "it/s",
    "tps",  # torchtitan
    "wps",
    "throughput",  # Megatron
    "throughput(*)",  # torchtitan: throughput(tps)
    "*_throughput",
    # compute
    "mfu",
    "mfu(*)",  # torchtitan: mfu(%)
    "*_mfu",
    "tflops",
    "tflops_*",  # NeMo: TFLOPS_per_GPU
    "*_tflops",
    "flops",
    "*_flops",
    # memory
    "memory",
    "memory(*)",
    "memory_*",
    "*_memory",
    "*_memory_*",  # max_memory_allocated_gb, system_memory_usage_megabytes
    "*_memory(*)",
    "mem-*",  # Megatron: mem-allocated-bytes, mem-max-allocated-bytes
    "mem_*",
    "*_mem",
    "*_mem_*",
    "allocated_bytes.*.*",  # torch.cuda.memory_stats (Lightning): allocated_bytes.all.current
    "reserved_bytes.*.*",
    "active_bytes.*.*",
    "requested_bytes.*.*",
    "inactive_split_bytes.*.*",
)
"""The metrics ``default_policy`` ignores: run-to-run noise (time, throughput, memory, mfu) in
the stacks people bring (verl, torchtitan, Megatron, HF, Lightning, NeMo, Composer, MLflow),
which never reproduces.

Patterns are over the lower-cased name's segments, which ``/`` or ``.`` separate (W&B joins
nested keys with ``.``), and a ``/`` or ``.`` in a pattern is either: ``GROUP/**`` matches every
name that starts with the segment(s) GROUP (``perf/**``: ``perf/mfu/actor``, ``perf.mfu``); any
other pattern matches the name's last segment(s) (``time``: ``train/time``, never
``rl/timestep_reward``; ``tokens/s``: the last two). ``*`` stands for any run of characters
within one segment, so ``*_memory_*`` holds ``max_memory_allocated_gb`` but not
``eval/memorization``. A name whose last segment counts tokens (``JUDGED_COUNTERS``) is judged
even inside a group (``perf/total_num_tokens``).
"""

JUDGED_COUNTERS: tuple[str, ...] = ("*tokens",)
"""Last segments judged even where a NOISE_PATTERNS group holds them: counters, not rates
(verl's ``perf/total_num_tokens``); ``perf/tokens_per_s`` stays ignored."""

# Literal pieces one of which every name NOISE_PATTERNS matches holds ("\n" ends the name):
# a whole list of names is searched for them at once, and only names that hold one are matched
# against the patterns (tests check every pattern holds one).
NOISE_KEYWORDS = (
    "tim", "mem", "perf", "throughput", "system", "devicestats", "elapsed", "per_s", "/s\n",
    ".s\n", "tps\n", "wps\n", "mfu", "flops", "bytes",
)  # fmt: skip


def _pattern_regex(pattern: str) -> str:
    """A NOISE_PATTERNS pattern as a regex over a whole lower-cased name (see there)."""
    group = pattern.endswith("/**")
    body = pattern[:-3] if group else pattern
    words = {"*": "[^/.]*", "/": "[/.]", ".": "[/.]"}
    regex = "".join(words.get(c, re.escape(c)) for c in body)
    return regex + "[/.].+" if group else "(?:.*[/.])?" + regex


_NOISE_RE = re.compile("|".join(f"(?:{_pattern_regex(p)})" for p in NOISE_PATTERNS), re.DOTALL)
_COUNTER_RE = re.compile("|".join(f"(?:{_pattern_regex(p)})" for p in JUDGED_COUNTERS), re.DOTALL)


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
            raise PolicyError(f"bad policy kind {self.kind!r}")
        if (
            isinstance(self.ulp, bool)
            or not isinstance(self.ulp, int)
            or not 0 <= self.ulp < ULP_MAX  # ULP_MAX: NaN's and inf's distance from a number
        ):
            raise PolicyError(
                f"bad policy: ulp must be a non-negative integer below {ULP_MAX} (the distance "
                f"of NaN and inf from any number), got {self.ulp!r}"
            )
        for name in ("rtol", "atol"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise PolicyError(f"bad policy: {name} must be finite and >= 0, got {v!r}")
        object.__setattr__(self, "pieces", tuple(self.pieces))
        if (self.kind == "steps") != bool(self.pieces):
            raise PolicyError("bad policy: pieces go with kind 'steps', and only with it")
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
                raise PolicyError(
                    f"bad policy {text!r}: step range {steps.strip()!r} is not N, A-B, A- or -B"
                )
            lo, hi = (m["one"], m["one"]) if m["one"] is not None else (m["lo"], m["hi"])
            pieces.append(StepRange(_bound(lo, text), _bound(hi, text), policy))
        try:
            return cls("steps", pieces=tuple(pieces))
        except PolicyError as e:
            why = str(e).removeprefix("bad policy: ")
            raise PolicyError(f"bad policy {text!r}: {why}") from None

    def piece_at(self, step: int) -> str:
        """The policy in force at ``step``, as text (a step policy's piece, with its range)."""
        if self.kind != "steps":
            return str(self)
        index = int(piece_index(self.pieces, np.array([step], dtype=np.int64))[0])
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
    digits = arg.strip()
    if kind == "ulp" and digits.isdigit() and (len(digits) > 20 or int(digits) >= ULP_MAX):
        raise PolicyError(
            f"bad policy {text!r}: ulp:K must be below {ULP_MAX}, the distance of NaN and inf "
            "from any number (a wider tolerance: close:RTOL,ATOL)"
        )
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
    raise PolicyError(
        f"bad policy {text!r}: expected exact, ulp:K, close:RTOL,ATOL or ignore, "
        "optionally with @STEPS pieces (exact@-5,ulp:4@6-)"
    )


def _bound(digits: str | None, text: str) -> int | None:
    """A step range's bound (None where left open); one past MAX_STEP is refused before int()
    reads it, which would take thousands of digits for a ValueError of its own."""
    if not digits:
        return None
    digits = digits.lstrip("0") or "0"
    if len(digits) > len(str(MAX_STEP)) or int(digits) > MAX_STEP:
        raise PolicyError(f"bad policy {text!r}: a step range bound is past step {MAX_STEP}")
    return int(digits)


def _check_pieces(pieces: tuple[StepRange, ...]) -> None:
    """Simple policies, at most one fallback, sane and disjoint ranges."""
    if any(p.policy.kind == "steps" for p in pieces):
        raise PolicyError("bad policy: a piece of a step policy cannot be a step policy")
    ranged = [p for p in pieces if p.first is not None or p.last is not None]
    if len(pieces) - len(ranged) > 1:
        raise PolicyError("bad policy: more than one piece without a step range")
    for p in ranged:
        if p.first is not None and p.last is not None and p.first > p.last:
            raise PolicyError(f"bad policy: empty step range in {p}")
    ranged.sort(key=lambda p: -1 if p.first is None else p.first)
    for prev, cur in zip(ranged, ranged[1:], strict=False):
        if prev.last is None or cur.first is None or cur.first <= prev.last:
            raise PolicyError(f"bad policy: step ranges of {prev} and {cur} overlap")


def piece_index(pieces: tuple[StepRange, ...], steps: np.ndarray) -> np.ndarray:
    """For each step, the index of the piece in force; -1 where none is (judged exact)."""
    which = np.full(len(steps), -1, dtype=np.int64)
    for i, p in enumerate(pieces):  # the fallback first: ranged pieces override it
        if p.first is None and p.last is None:
            which[:] = i
    for i, p in enumerate(pieces):
        if p.first is not None or p.last is not None:
            which[p.covers(steps)] = i
    return which


_EXACT, _IGNORE = Policy("exact"), Policy("ignore")


def _is_noise(metric: str) -> bool:
    name = metric.lower()
    return _NOISE_RE.fullmatch(name) is not None and _COUNTER_RE.fullmatch(name) is None


def default_policy(metric: str) -> Policy:
    """Run-to-run noise (a name NOISE_PATTERNS holds: time, throughput, memory, mfu) is ignored,
    since it never reproduces; everything else is exact."""
    return _IGNORE if _is_noise(metric) else _EXACT


def noise_mask(names: list[str]) -> np.ndarray:
    """_is_noise of many names: the joined names are searched for NOISE_KEYWORDS once, and only
    the names holding one are matched, so a long list of names costs a few string scans."""
    out = np.zeros(len(names), dtype=bool)
    text = "\n".join(names).lower() + "\n"
    if text.count("\n") != len(names):  # a name holds a "\n": one by one
        out[:] = [_is_noise(n) for n in names]
        return out
    hits = []
    for word in NOISE_KEYWORDS:
        at = text.find(word)
        while at != -1:
            hits.append(at)
            at = text.find(word, at + 1)
    line, done = 0, 0
    for at in sorted(hits):
        line += text.count("\n", done, at)  # the name a hit is in: the newlines before it
        done = at
        out[line] = _is_noise(names[line])
    return out


#: metric name or fnmatch glob -> its policy, as every judge below the API's entry points takes it
Policies = Mapping[str, Policy]


def parse_policies(
    policies: Mapping[str, Policy | str] | None, source: str = "policies"
) -> dict[str, Policy]:
    """The one place policy texts become Policy objects: ``policies`` (metric or glob -> a Policy
    or its text) in the same order, every text parsed; a bad one raises PolicyError naming
    ``source`` and the metric. The entry points a caller uses (the CLI, the package's functions,
    the pytest plugin, compare_frames) call it once; below them policies travel parsed."""
    out: dict[str, Policy] = {}
    for metric, policy in (policies or {}).items():
        if isinstance(policy, Policy):
            out[metric] = policy
            continue
        if not isinstance(policy, str):
            raise PolicyError(f"{source}: {metric!r}: a policy is text or a Policy, got "
                              f"{type(policy).__name__}")  # fmt: skip
        try:
            out[metric] = Policy.parse(policy)
        except PolicyError as e:
            raise PolicyError(f"{source}: {metric!r}: {e}") from None
    return out


def resolve_policy(metric: str, policies: Policies) -> Policy:
    """Exact name first, then the first matching glob in mapping order, then the default."""
    chosen = policies.get(metric)
    if chosen is None:
        chosen = next(
            (p for pat, p in policies.items() if fnmatch.fnmatchcase(metric, pat)),
            None,
        )
    return default_policy(metric) if chosen is None else chosen


_GLOB = re.compile(r"[*?\[]")


def resolve_all(names: list[str], policies: Policies) -> tuple[np.ndarray, list[Policy]]:
    """resolve_policy of every name, as an index per name into a list of the distinct policies;
    a glob is matched only against names no earlier rule took."""
    distinct: list[Policy] = [_EXACT, _IGNORE]
    which = np.zeros(len(names), dtype=np.int64)
    taken = np.zeros(len(names), dtype=bool)
    if policies:
        parsed = {}
        for pat, p in policies.items():
            parsed[pat] = len(distinct)
            distinct.append(p)
        at = {name: j for j, name in enumerate(names)}
        for pat, k in parsed.items():
            j = at.get(pat)
            if j is not None:
                which[j], taken[j] = k, True
        for pat, k in parsed.items():
            if not _GLOB.search(pat):  # a plain name matches only itself: taken above
                continue
            match = re.compile(fnmatch.translate(pat)).match
            hit = [j for j in np.flatnonzero(~taken).tolist() if match(names[j])]
            which[hit], taken[hit] = k, True
    rest = np.flatnonzero(~taken)
    left = names if len(rest) == len(names) else [names[j] for j in rest.tolist()]
    which[rest[noise_mask(left)]] = 1
    return which, distinct
