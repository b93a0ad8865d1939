"""When a text log's values look rounded (frame.rounded_places): a log written in full is never
read as rounded, so an exact policy on it never gives a false "imprecise"; a rounded one is.

A training loop logs Python's repr of its floats: computed float64 values (15-17 digits), a
float32 loss's `.item()`, learning rates from a schedule, means over a batch, token counts.
None of them may read as `decimals:N`; values written with `f"{x:.4f}"` must.
"""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from parity.readers import read_metrics
from parity.readers.frame import MEAN_EVIDENCE, rounded_places

PROPERTY = settings(max_examples=200, deadline=None, derandomize=True)


def _float64_bits(sign: bool, exponent: int, mantissa: int) -> float:
    """A float64 from its fields: what a computation gives, no decimal chose it."""
    bits = (int(sign) << 63) | ((exponent + 1023) << 52) | mantissa
    return float(np.array(bits, dtype=np.uint64).view(np.float64))


float64_values = st.builds(
    _float64_bits, st.booleans(), st.integers(-30, 30), st.integers(0, 2**52 - 1)
)
float32_values = st.floats(width=32, allow_nan=False, allow_infinity=False).map(
    lambda x: float(np.float32(x))
)


@PROPERTY
@given(st.lists(float32_values, min_size=1, max_size=40))
def test_float32_values_are_never_read_as_rounded(values):
    """A float32 (a loss's `.item()`) is the float64 of a short decimal only when it is a short
    binary fraction (0.5, 0.3125), and those witness nothing: never rounded."""
    assert rounded_places(np.array(values)) is None


@PROPERTY
@given(st.lists(float64_values, min_size=1, max_size=40))
def test_computed_float64_values_are_never_read_as_rounded(values):
    """Python's repr of a computed float64 has 15-17 digits: never rounded."""
    assert rounded_places(np.array([float(repr(x)) for x in values])) is None


@PROPERTY
@given(
    places=st.integers(3, 5),
    units=st.lists(st.integers(0, 10**9), max_size=40),
    whole=st.integers(0, 999),
)
def test_values_written_with_few_decimals_are_read_as_rounded(places, units, whole):
    """A series at N places holding one value that ends in 1, 3, 7 or 9 there (no mean over
    40 or 80 samples gives that) and has 4 significant digits (a witness) reads decimals N."""
    scale = 10**places
    witness = (whole * scale + scale + 1) / scale  # e.g. 1.001 at 3 places
    values = [witness] + [u / scale for u in units]
    assert rounded_places(np.array(values)) == places


def _steplr(lr: float, gamma: float, steps: int) -> list[float]:
    out = []
    for _ in range(steps):
        out.append(lr)
        lr *= gamma  # torch's StepLR multiplies: 0.09000000000000001, ...
    return out


FULL_LOGS = {
    "warmup lr 3e-4 * step / 10": [3e-4 * s / 10 for s in range(1, 11)],
    "warmup then constant": [3e-4 * min(1.0, s / 10) for s in range(1, 40)],
    "StepLR 0.1 * 0.9 per step": _steplr(0.1, 0.9, 6),
    "0.1 * 0.9**k, k < 5 (0.0729, 0.06561 are short)": [0.1 * 0.9**k for k in range(5)],
    "linear decay": [3e-4 * (1 - s / 100) for s in range(100)],
    "cosine": [1.5e-4 * (1 + math.cos(math.pi * s / 50)) for s in range(50)],
    "a constant lr": [0.0003] * 20,
    "lr set from a list": [0.1, 0.01, 0.001, 0.0001],
    "mean over 40 samples": [100 + k / 40 for k in range(0, 1000, 37)],
    "mean over 80 samples": [k / 80 for k in range(1, 400, 13)],
    "0/1 rewards over a batch of 40": [k / 40 for k in (3, 17, 22, 25, 31, 9, 14, 38, 27, 11)],
    "epoch over 125 steps": [s / 125 for s in range(1, 400, 7)],
    "mean over 64 samples": [k / 64 for k in range(1, 640, 11)],
    "token counts": [float(1000 * s + 7 * s * s) for s in range(1, 30)],
    "tokens past 1e9": [1e9 + 12345.5 * s for s in range(10)],
    "grad norms (float32)": [float(np.float32(1.0 / (s + 0.37))) for s in range(1, 30)],
    "losses (float64)": [math.log(50000) - s / 7.3 for s in range(30)],
}


@pytest.mark.parametrize("values", list(FULL_LOGS.values()), ids=list(FULL_LOGS))
def test_real_full_precision_logs_are_not_read_as_rounded(values):
    assert rounded_places(np.array(values)) is None, [repr(v) for v in values]


def test_a_mean_logged_too_few_times_cannot_be_told_from_a_rounding():
    """Below MEAN_EVIDENCE distinct values a mean over 40 samples is read as rounded: the safe
    side (imprecise, never a false aligned); so is a lone 4-digit constant."""
    means = [100 + k / 40 for k in range(1, 40, 7)]
    assert len(set(means)) < MEAN_EVIDENCE and rounded_places(np.array(means)) == 3
    assert rounded_places(np.array([0.06561] * 5)) == 5


def test_a_csv_log_reads_full_or_rounded_as_written(tmp_path):
    """Through a reader: the same losses written in full (repr) and with `%.4f`."""
    losses = [2.0 + math.sin(s) / 3 for s in range(1, 20)]
    means = [s * 7 / 40 for s in range(1, 20)]  # a mean over 40 samples, in full
    full, short = tmp_path / "full.csv", tmp_path / "short.csv"
    rows = zip(range(1, 20), losses, means, strict=True)
    full.write_text("step,loss,acc\n" + "".join(f"{s},{x!r},{m!r}\n" for s, x, m in rows))
    short.write_text("step,loss\n" + "".join(f"{s},{x:.4f}\n" for s, x in enumerate(losses, 1)))
    assert read_metrics(full).attrs["precision"] == {"acc": "float64", "loss": "float64"}
    assert read_metrics(short).attrs["precision"] == {"loss": "decimals:4"}
